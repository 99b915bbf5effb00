"""`strata serve --stages 2` on one device runs both stages in one process: the same text as one stage and as two
stage processes, the activations handed over in memory (the second stage counts them), and a SIGKILL of that process
recovered by supervision with both its stages, as a single stage's is.

Real `strata serve` processes on the generated four-layer model, on the CPU.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from strata.rpc.v1 import stage_pb2, stage_pb2_grpc
from strata_testbed.serve import Served, stage_pid, strata_serve

ARGS = ("--stages", "2", "--parallel", "2", "--context", "1024")
BACK_WITHIN_S = 30.0
REQUEST_TIMEOUT_S = 10.0
PROMPTS = ("The quick brown fox", "Once upon a time, in a land far away,", "1 2 3 4 5")


def stage_port(served: Served, index: int) -> int:
    line = served.output.wait_for(lambda line: line.startswith(f"stage {index}: layers"), timeout=0)
    assert line is not None, served.output.text()
    return int(line.rsplit(":", 1)[1])


def load_status(served: Served, index: int) -> stage_pb2.LoadStatus:
    with grpc.insecure_channel(f"127.0.0.1:{stage_port(served, index)}") as channel:
        status: stage_pb2.LoadStatus = stage_pb2_grpc.StageStub(channel).GetLoadStatus(
            stage_pb2.LoadStatusRequest(), timeout=10
        )
    return status


def texts(served: Served) -> list[str]:
    out = []
    for prompt in PROMPTS:
        body = {"model": served.model, "prompt": prompt, "max_tokens": 24, "temperature": 0}
        reply = httpx.post(f"{served.base_url}/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        out.append(reply.json()["choices"][0]["text"])
    return out


@pytest.fixture(scope="module")
def co_located(qwen2_model: Path) -> Iterator[Served]:
    with strata_serve(str(qwen2_model), *ARGS) as served:
        yield served


def test_two_stages_in_one_process_write_what_one_stage_and_two_processes_write(
    qwen2_model: Path, co_located: Served
) -> None:
    with strata_serve(str(qwen2_model), "--stages", "1", *ARGS[2:]) as one:
        expected = texts(one)
    with strata_serve(str(qwen2_model), *ARGS, "--process-per-stage") as separate:
        assert texts(separate) == expected
        apart = load_status(separate, 1)
    before = load_status(co_located, 1).activations_in_process
    assert texts(co_located) == expected
    together = load_status(co_located, 1)

    assert "stages 0 and 1 share one process on cpu" in co_located.output.text()
    assert stage_pid(co_located.process.pid, 0) == stage_pid(co_located.process.pid, 1) is not None
    assert together.activations_in_process > before, "the second stage took the first's activations in memory"
    assert together.activations_inline == together.activations_shared == 0, "no step left the process"
    assert apart.activations_shared > 0, "two processes share memory instead"
    assert apart.activations_in_process == 0


def test_the_shared_process_killed_comes_back_with_both_stages_within_30_s(co_located: Served) -> None:
    served = co_located
    ports = [stage_port(served, 0), stage_port(served, 1)]
    terms = [load_status(served, index).accepted_term for index in (0, 1)]
    pid = stage_pid(served.process.pid, 1)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    body = {"model": served.model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    while (
        reply := httpx.post(f"{served.base_url}/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    ).status_code != 200:
        assert (reply.status_code, reply.headers.get("retry-after")) == (503, "1"), reply.text
        assert time.monotonic() - killed < BACK_WITHIN_S, f"not serving {BACK_WITHIN_S:.0f} s after the kill"
        time.sleep(0.2)
    print(f"both stages serving again {time.monotonic() - killed:.1f} s after SIGKILL")
    output = served.output.text()
    assert f"the process of stages 0 and 1 was killed by SIGKILL; restarting it on ports {ports[0]} and {ports[1]}" in (
        output
    )
    assert f"the process of stages 0 and 1 restarted on ports {ports[0]} and {ports[1]}" in output
    after = [load_status(served, index).accepted_term for index in (0, 1)]
    assert all(now > then for now, then in zip(after, terms, strict=True)), f"terms {terms}, then {after}"
    assert stage_pid(served.process.pid, 0) == stage_pid(served.process.pid, 1) not in (None, pid)
