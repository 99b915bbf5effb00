"""`strata serve` with a stage that cannot load: it prints that stage's error and exits 1 within 10 s of the failure,
where it used to wait without a word; and it refuses at start a model its stages cannot run. A reported load failure
is never retried, not even in a stage started again after its process died; a stage whose process dies while it
loads is the supervisor's: started again at once, and given up on when it keeps dying.

Failures come from real files (tensor data cut short) and from faults injected into the stage worker processes
(tests/stage_faults): memory that runs out, a decode step that runs on no path, a stage killed mid-load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from strata.gguf.testmodels import LARGE_SHAPES, write_header_only_model
from strata_testbed.broken_models import cut_tensor_data
from strata_testbed.processes import OutputLines
from strata_testbed.serve import stage_pid

FAULTS = Path(__file__).parents[1] / "stage_faults"
FAIL_WITHIN_S = 10.0
START_TIMEOUT_S = 120.0
GIVES_UP_WITHIN_S = 60.0  # a stage killed twice: a backoff, a start and a second death


def fault_env(fault: str = "", *, after_first: Path | None = None) -> dict[str, str]:
    """This environment with the stage faults on PYTHONPATH, and `fault` for the stage workers (after the first one
    when `after_first` names the marker file)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAULTS), os.environ.get("PYTHONPATH", "")])}
    if fault:
        env["STRATA_TEST_FAULT"] = fault
    if after_first is not None:
        env["STRATA_TEST_FAULT_AFTER_FIRST"] = str(after_first)
    return env


@contextlib.contextmanager
def serve(model: Path, *args: str, env: dict[str, str]) -> Iterator[tuple[subprocess.Popen[bytes], OutputLines]]:
    """`strata serve MODEL ARGS` and its output as it comes; killed, with its stages, if it still runs at the end."""
    argv = [sys.executable, "-m", "strata.cli", "serve", str(model), "--port", "0", *args]
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    assert process.stdout is not None
    try:
        yield process, OutputLines(process.stdout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        process.stdout.close()


def exit_code(process: subprocess.Popen[bytes], output: OutputLines, *, within_s: float, since: str) -> int:
    try:
        return process.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"strata serve still runs {within_s:g} s after {since}:\n{output.text()}")


def wait_for_line(output: OutputLines, start: str, *, timeout: float) -> str:
    line = output.wait_for(lambda seen: seen.startswith(start), timeout=timeout)
    assert line is not None, f"no line starting {start!r} within {timeout:g} s:\n{output.text()}"
    return line


def failure_line(output: OutputLines, code: int) -> str:
    """The line serve printed when a failure stopped it; it must have exited with status 1."""
    assert code == 1, output.text()
    return wait_for_line(output, "strata serve: ", timeout=1.0)


@dataclasses.dataclass(frozen=True)
class Case:
    keep: float = 1.0  # the share of the tensor data the file keeps
    stages: int = 1
    fault: str = ""  # STRATA_TEST_FAULT for the stage workers
    failing: int = 0  # the stage that fails
    message: str = ""
    args: tuple[str, ...] = ()  # more flags for serve


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            Case(keep=0.5, message="its tensor data is cut short"), id="a file whose tensor data is cut short"
        ),
        pytest.param(
            Case(keep=0.75, stages=2, failing=1, message="inside tensor 'blk.3.", args=("--process-per-stage",)),
            id="the last stage's tensors cut short while the first stage starts",
        ),
        pytest.param(
            Case(keep=0.75, stages=2, failing=1, message="inside tensor 'blk.3."),
            id="the second of two stages in one process cut short: its own error, though the first loads",
        ),
        pytest.param(
            Case(fault="kv-pool-out-of-memory", message="OutOfMemoryError: CUDA out of memory. Tried to allocate"),
            id="memory running out for the KV pool",
        ),
        pytest.param(
            Case(fault="decode-step-fails", message="the decode step runs on no path: eager: RuntimeError: CUDA error"),
            id="a decode step that runs on no path",
        ),
    ],
)
def test_a_stage_that_fails_to_load_stops_serve_with_its_error(qwen2_model: Path, tmp_path: Path, case: Case) -> None:
    model = cut_tensor_data(qwen2_model, tmp_path / "cut.gguf", keep=case.keep) if case.keep < 1 else qwen2_model
    with serve(model, "--stages", str(case.stages), *case.args, env=fault_env(case.fault)) as (process, output):
        # The failing stage starts listening before it loads: from this line on, its failure may happen any time.
        wait_for_line(output, f"stage {case.failing}: layers", timeout=START_TIMEOUT_S)
        listening = time.monotonic()
        code = exit_code(process, output, within_s=FAIL_WITHIN_S, since=f"stage {case.failing} started")
        exited = time.monotonic() - listening
    reported = failure_line(output, code)
    assert reported.startswith(f"strata serve: stage {case.failing} failed to load: "), output.text()
    assert case.message in output.text()
    assert "ready" not in output.text().split()
    assert "restarting it" not in output.text(), "a failed load is not retried"
    shared = case.stages > 1 and "--process-per-stage" not in case.args
    assert ("stages 0 and 1 share one process on cpu" in output.text()) == shared, output.text()
    print(f"strata serve exited {exited:.1f} s after stage {case.failing} started")


def test_a_stage_killed_while_it_loads_is_started_again_and_given_up_on_when_it_keeps_dying(
    qwen2_model: Path,
) -> None:
    env = fault_env("killed-while-loading")
    with serve(qwen2_model, "--stage-restarts", "1", env=env) as (process, output):
        wait_for_line(output, "stage 0: layers", timeout=START_TIMEOUT_S)
        wait_for_line(output, "stage 0 was killed by SIGKILL; restarting it on port", timeout=FAIL_WITHIN_S)
        code = exit_code(process, output, within_s=GIVES_UP_WITHIN_S, since="stage 0 was killed")
    reported = failure_line(output, code)
    assert reported.startswith(
        "strata serve: stage 0 died 2 times within 60 s, the last time was killed by SIGKILL; giving up."
    ), output.text()
    assert "ready" not in output.text().split()


def test_a_stage_started_again_that_fails_to_load_stops_serve_with_its_error(qwen2_model: Path, tmp_path: Path) -> None:
    env = fault_env("kv-pool-out-of-memory", after_first=tmp_path / "first-worker-started")
    with serve(qwen2_model, env=env) as (process, output):
        wait_for_line(output, "ready", timeout=START_TIMEOUT_S)
        pid = stage_pid(process.pid, 0)
        assert pid is not None, output.text()
        os.kill(pid, signal.SIGKILL)
        # The restart's own "restarted on" line may come after its failed load is seen (the new process listens on
        # the old port before it loads), so the test waits for the line printed before the restart, not after it.
        wait_for_line(output, "stage 0 was killed by SIGKILL; restarting it on port", timeout=FAIL_WITHIN_S)
        code = exit_code(process, output, within_s=FAIL_WITHIN_S, since="stage 0 was restarted")
    reported = failure_line(output, code)
    assert reported.startswith(
        "strata serve: stage 0 failed to load: OutOfMemoryError: CUDA out of memory. Tried to allocate"
    ), output.text()
    assert output.text().count("restarting it on port") == 1, "the restart's failed load is not retried"


REFUSED_BY_SERVE = {
    "an architecture the stages do not run": (
        dataclasses.replace(LARGE_SHAPES["llama3-8b"], architecture="falcon", block_count=2),
        "strata serve: architecture 'falcon' is not one the stage worker runs "
        "(gemma2, gemma3, llama, mistral, phi3, qwen2, qwen3, qwen3moe)",
    ),
    "a RoPE scaling the stages do not apply": (
        dataclasses.replace(LARGE_SHAPES["llama3-8b"], block_count=2, rope_keys=(("scaling.type", "yarn"),)),
        "strata serve: llama.rope.scaling.type is 'yarn': the stage worker applies none and linear RoPE scaling "
        "and llama.cpp's rope_freqs.weight factors only",
    ),
}


@pytest.mark.parametrize("case", REFUSED_BY_SERVE)
def test_serve_refuses_a_model_its_stages_cannot_run(tmp_path: Path, case: str) -> None:
    shape, message = REFUSED_BY_SERVE[case]
    model = write_header_only_model(tmp_path / "model.gguf", shape=shape).path
    result = subprocess.run(
        [sys.executable, "-m", "strata.cli", "serve", str(model), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert result.stderr.strip() == message
    assert "stage 0" not in result.stdout, "no stage may start"


REFUSED_OPTIONS = {
    "a host KV memory that is no quantity": (
        ("--kv-host-memory", "lots"),
        "strata serve: --kv-host-memory 'lots' is not a Kubernetes quantity such as 80Gi",
    ),
    "a prefill chunk wider than the plan's micro-batch": (
        ("--prefill-chunk", "1024"),
        "strata serve: --prefill-chunk: the prefill chunk must be 1 to 512 tokens (the rows a step the plan sizes a "
        "stage's activations and sliding-window cells for), not 1024",
    ),
}


@pytest.mark.parametrize("case", REFUSED_OPTIONS)
def test_serve_refuses_an_option_it_cannot_honour_naming_it(tmp_path: Path, case: str) -> None:
    options, message = REFUSED_OPTIONS[case]
    model = write_header_only_model(tmp_path / "model.gguf", shape=LARGE_SHAPES["llama3-8b"]).path
    result = subprocess.run(
        [sys.executable, "-m", "strata.cli", "serve", str(model), "--port", "0", *options],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert result.stderr.strip() == message
    assert "stage 0" not in result.stdout, "no stage may start"
