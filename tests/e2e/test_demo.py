"""End to end: `make demo`'s own module, from `helm install` and `kubectl apply` to an OpenAI answer and back.

The demo runs as a person runs it (a process that prints progress and serves until Ctrl-C). The tests talk to it
only through what it prints: the OpenAI endpoint, KUBECONFIG and KUBECTL. The answer is checked against HF
transformers' greedy continuation from the same GGUF file; deleting the deployment must stop every pod process and
remove every object, and Ctrl-C must leave no process behind.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import torch
from strata_testbed.hf_reference import hf_reference
from strata_testbed.processes import OutputLines
from strata_testbed.waiting import eventually
from transformers import AutoTokenizer

pytestmark = pytest.mark.cluster

START_TIMEOUT_S = 600.0
# Apply to Ready on a 2-core machine: plan, two processes start Python and torch, the stage loads over HTTP.
READY_BOUND_S = 180.0
PROMPT = [1, 17, 200, 3, 45, 99, 12, 7, 250, 31]
NEW_TOKENS = 16


@dataclass
class RunningDemo:
    process: subprocess.Popen[bytes]
    output: OutputLines | None = None
    values: dict[str, str] = field(default_factory=dict)

    def line(self, pattern: str) -> re.Match[str]:
        assert self.output is not None
        for line in self.output.lines:
            found = re.search(pattern, line)
            if found:
                return found
        raise AssertionError(f"the demo printed no line matching {pattern!r}:\n{self.output.text()}")

    def kubectl(self, *args: str) -> str:
        argv = [self.values["KUBECTL"], "--kubeconfig", self.values["KUBECONFIG"], *args]
        return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout

    @property
    def work_dir(self) -> Path:
        return Path(self.values["KUBECONFIG"]).parents[1]


def _read_until_ready(demo: RunningDemo) -> None:
    """Wait for the three lines for scripts; the last of them, KUBECTL=, ends what the demo prints when ready."""
    assert demo.process.stdout is not None
    demo.output = OutputLines(demo.process.stdout)
    if demo.output.wait_for(lambda line: line.startswith("KUBECTL="), timeout=START_TIMEOUT_S) is None:
        raise AssertionError("the demo did not become ready:\n" + demo.output.text())
    for line in demo.output.lines:
        for key in ("KUBECONFIG", "KUBECTL"):
            if line.startswith(f"{key}="):
                demo.values[key] = line.split("=", 1)[1].strip()
        if line.startswith("OpenAI endpoint: "):
            demo.values["endpoint"] = line.split(": ", 1)[1].strip()


def _processes_under(folder: Path) -> list[str]:
    """Command lines of live processes that name `folder` in their arguments or environment (every demo process
    does: the control plane by its data and certificate paths, pod processes by their HOME)."""
    found = []
    needle = str(folder).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in cmdline or needle in environ:
            found.append(cmdline.replace(b"\0", b" ").decode(errors="replace").strip())
    return found


@pytest.fixture(scope="module")
def demo() -> Iterator[RunningDemo]:
    process = subprocess.Popen(
        [sys.executable, "-m", "strata_testbed.demo", "--keep-logs"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    running = RunningDemo(process=process)
    try:
        _read_until_ready(running)
        yield running
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        if "KUBECONFIG" in running.values:
            subprocess.run(["rm", "-rf", str(running.work_dir)], check=False)


def test_the_deployment_is_ready_within_the_bound_and_the_demo_prints_its_answer(demo: RunningDemo) -> None:
    seconds = float(demo.line(r"is Ready ([\d.]+) s after kubectl apply").group(1))
    print(f"apply to Ready: {seconds:.1f} s")
    assert seconds < READY_BOUND_S
    assert demo.line(r"^> Say hello to Kubernetes\.")
    assert re.fullmatch(r"http://127\.[\d.]+:\d+/v1", demo.values["endpoint"])


def test_the_printer_columns_show_stages_context_ready_and_why(demo: RunningDemo) -> None:
    header, row = demo.kubectl("get", "modeldeployments", "--namespace", "default").splitlines()[:2]
    assert header.split() == ["NAME", "MODEL", "STAGES", "CONTEXT", "READY", "PIPELINES", "PHASE", "REASON", "AGE"]
    name, model, stages, context, ready, pipelines, phase, reason, _ = row.split()
    assert (name, model, phase, reason) == ("tiny", "tiny", "Ready", "Ready")
    assert int(stages) >= 1
    assert ready == f"{stages}/{stages}"
    assert pipelines == "1/1"
    plan_context = demo.kubectl(
        "get", "modeldeployment", "tiny", "--namespace", "default", "-o", "jsonpath={.status.contextLength}"
    )
    assert context == plan_context
    assert int(context) >= 512


def test_the_greedy_answer_through_the_cluster_equals_hf_transformers(demo: RunningDemo) -> None:
    model_path = Path(demo.line(r"^\[.*\] model: (\S+\.gguf) ").group(1))
    reply = httpx.post(
        f"{demo.values['endpoint']}/completions",
        json={"model": "tiny", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0},
        timeout=120,
    )
    reply.raise_for_status()
    answer = reply.json()["choices"][0]["text"]

    reference = hf_reference(model_path)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)
    ids = list(PROMPT)
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] == tokenizer.eos_token_id:
                ids.pop()
                break
    assert answer == tokenizer.decode(ids[len(PROMPT) :])


def test_deleting_the_deployment_stops_its_pod_processes_and_removes_its_objects(demo: RunningDemo) -> None:
    demo.kubectl("delete", "modeldeployment", "tiny", "--namespace", "default", "--wait=false")

    def gone() -> bool:
        listed = demo.kubectl(
            "get",
            "statefulsets,deployments,services,configmaps,pods,poddisruptionbudgets,networkpolicies,leases",
            "--namespace",
            "default",
            "--selector",
            "app.kubernetes.io/instance=tiny",
            "-o",
            "name",
        )
        return not listed.strip()

    eventually(gone, timeout=120, what="the garbage collector to remove every child of tiny")

    def stopped() -> bool:
        workloads = [c for c in _processes_under(demo.work_dir) if "stage-worker" in c or "strata gateway" in c]
        return not workloads

    eventually(stopped, timeout=60, what=f"the pod processes to stop: {_processes_under(demo.work_dir)}")
    # The operator the chart installed still runs: only the deployment's own processes went.
    assert any("strata operator" in c for c in _processes_under(demo.work_dir))


def test_ctrl_c_stops_every_process_of_the_demo(demo: RunningDemo) -> None:
    os.kill(demo.process.pid, signal.SIGINT)
    assert demo.process.wait(timeout=90) == 0
    assert demo.output is not None
    assert demo.output.wait_for(lambda line: line.startswith("stopped: every process"), timeout=10)
    eventually(lambda: not _processes_under(demo.work_dir), timeout=30, what="no process left")
