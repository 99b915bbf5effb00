"""`strata serve` with a stage that cannot load: it prints that stage's error and exits 1 within 10 s of the failure,
where it used to wait without a word; and it refuses at start a model its stages cannot run.

Failures come from real files (tensor data cut short) and from faults injected into the stage worker processes
(tests/gateway/stage_faults): memory that runs out, a decode step that runs on no path, a stage killed mid-load.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from strata.gguf.testmodels import LARGE_SHAPES, write_header_only_model
from strata_testbed.broken_models import cut_tensor_data
from strata_testbed.processes import OutputLines

FAULTS = Path(__file__).parent / "stage_faults"
FAIL_WITHIN_S = 10.0
START_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class Case:
    keep: float = 1.0  # the share of the tensor data the file keeps
    stages: int = 1
    fault: str = ""  # STRATA_TEST_FAULT for the stage workers
    failing: int = 0  # the stage that fails
    message: str = ""


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            Case(keep=0.5, message="its tensor data is cut short"), id="a file whose tensor data is cut short"
        ),
        pytest.param(
            Case(keep=0.75, stages=2, failing=1, message="inside tensor 'blk.3."),
            id="the last stage's tensors cut short while the first stage starts",
        ),
        pytest.param(
            Case(fault="kv-pool-out-of-memory", message="OutOfMemoryError: CUDA out of memory. Tried to allocate"),
            id="memory running out for the KV pool",
        ),
        pytest.param(
            Case(fault="decode-step-fails", message="the decode step runs on no path: eager: RuntimeError: CUDA error"),
            id="a decode step that runs on no path",
        ),
        pytest.param(
            Case(fault="killed-while-loading", message="its process was killed by signal 9"),
            id="a stage killed while it loads",
        ),
    ],
)
def test_a_stage_that_fails_to_load_stops_serve_with_its_error(qwen2_model: Path, tmp_path: Path, case: Case) -> None:
    model = cut_tensor_data(qwen2_model, tmp_path / "cut.gguf", keep=case.keep) if case.keep < 1 else qwen2_model
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAULTS), os.environ.get("PYTHONPATH", "")])}
    if case.fault:
        env["STRATA_TEST_FAULT"] = case.fault
    argv = [sys.executable, "-m", "strata.cli", "serve", str(model), "--stages", str(case.stages), "--port", "0"]
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    assert process.stdout is not None
    output = OutputLines(process.stdout)
    try:
        # The failing stage starts listening before it loads: from this line on, its failure may happen any time.
        stage_line = f"stage {case.failing}: layers"
        assert output.wait_for(lambda line: line.startswith(stage_line), timeout=START_TIMEOUT_S), output.text()
        listening = time.monotonic()
        try:
            code = process.wait(timeout=FAIL_WITHIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"strata serve still runs {FAIL_WITHIN_S:g} s after the stage failed:\n{output.text()}")
        exited = time.monotonic() - listening
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        process.stdout.close()
    reported = output.wait_for(lambda line: line.startswith("strata serve: "), timeout=1.0) or ""
    assert code == 1, output.text()
    assert reported.startswith(f"strata serve: stage {case.failing} failed to load: "), output.text()
    assert case.message in output.text()
    assert "ready" not in output.text().split()
    print(f"strata serve exited {exited:.1f} s after stage {case.failing} started")


def test_serve_refuses_a_model_its_stages_cannot_run(tmp_path: Path) -> None:
    shape = dataclasses.replace(LARGE_SHAPES["llama3-8b"], architecture="gemma3", block_count=2)
    model = write_header_only_model(tmp_path / "gemma3.gguf", shape=shape).path
    result = subprocess.run(
        [sys.executable, "-m", "strata.cli", "serve", str(model), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "strata serve: architecture 'gemma3' is not one the stage worker runs (llama, mistral, qwen2, qwen3)"
    )
    assert "stage 0" not in result.stdout, "no stage may start"
