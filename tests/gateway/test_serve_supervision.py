"""`strata serve` brings a killed stage back, as a StatefulSet would, and gives up on one that keeps dying.

A real `strata serve` of two stages, each a process of its own, on the generated four-layer model (stages that share
a process die and come back together: tests/gateway/test_serve_co_located.py). A stage is killed with SIGKILL while
a request runs through it: that request ends at once with a retryable error (503 with Retry-After, or the same error
as the stream's last event once a stream has begun), no request waits on the dead stage, and within 30 s of the kill
the stage is back on its port, claimed under a newer coordinator term, and requests get 200 again. A stage that dies
more often than `--stage-restarts` allows makes serve exit non-zero with how it died and the end of its log.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from strata.rpc.v1 import stage_pb2, stage_pb2_grpc
from strata_testbed.serve import Served, living, process_tree, stage_pid, strata_serve

BACK_WITHIN_S = 30.0  # the bound: killed to serving again
FAILS_WITHIN_S = 10.0  # a request running at the kill has its answer by then
REQUEST_TIMEOUT_S = 10.0  # no request may take longer while the stage is away: that would be a hang
EXITS_WITHIN_S = 60.0  # a stage given up on: serve has exited by then
PROMPT = list(range(100, 110))  # token ids: no template, no tokenizer in the way
LONG = 900  # tokens: the request still runs when the stage is killed after its first tokens


@pytest.fixture(scope="module")
def served(qwen2_model: Path) -> Iterator[Served]:
    args = ("--stages", "2", "--process-per-stage", "--parallel", "2", "--context", "1024")
    with strata_serve(str(qwen2_model), *args) as running:
        yield running


def stage_port(served: Served, index: int) -> int:
    line = served.output.wait_for(lambda line: line.startswith(f"stage {index}: layers"), timeout=0)
    assert line is not None, served.output.text()
    return int(line.rsplit(":", 1)[1])


def accepted_term(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        status: stage_pb2.LoadStatus = stage_pb2_grpc.StageStub(channel).GetLoadStatus(
            stage_pb2.LoadStatusRequest(), timeout=10
        )
    return status.accepted_term


def wait_until(condition: Callable[[], bool], *, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.05)


def kill_stage(served: Served, index: int) -> float:
    pid = stage_pid(served.process.pid, index)
    assert pid is not None, f"stage {index} runs under serve"
    os.kill(pid, signal.SIGKILL)
    return time.monotonic()


def completion(served: Served, *, max_tokens: int, stream: bool = False) -> dict[str, object]:
    return {"model": served.model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": stream}


@dataclass
class Answer:
    status: int
    retry_after: str | None
    code: object  # the OpenAI error's code; None without an error
    seconds: float


def ask_whole(served: Served, *, max_tokens: int) -> Answer:
    started = time.monotonic()
    reply = httpx.post(
        f"{served.base_url}/completions", json=completion(served, max_tokens=max_tokens), timeout=REQUEST_TIMEOUT_S
    )
    code = reply.json()["error"]["code"] if reply.status_code != 200 else None
    return Answer(reply.status_code, reply.headers.get("retry-after"), code, time.monotonic() - started)


def killed_under_a_whole_request(served: Served, index: int) -> tuple[float, Answer]:
    """Start a long non-streamed completion, kill the stage once it has generated tokens, and return its answer."""

    def generated() -> float:
        return served.metric("strata_gateway_tokens_generated_total", timeout_s=REQUEST_TIMEOUT_S)

    before = generated()
    answers: list[Answer] = []
    running = threading.Thread(target=lambda: answers.append(ask_whole(served, max_tokens=LONG)))
    running.start()
    wait_until(lambda: generated() > before + 2, what="the request to generate", timeout_s=30)
    killed = kill_stage(served, index)
    running.join(FAILS_WITHIN_S + REQUEST_TIMEOUT_S)
    assert answers, "the request running at the kill was answered"
    return killed, answers[0]


def killed_under_a_stream(served: Served, index: int) -> tuple[float, Answer]:
    """Start a long streamed completion, kill the stage after its first chunk, and return the stream's end."""
    body = completion(served, max_tokens=LONG, stream=True)
    with httpx.stream("POST", f"{served.base_url}/completions", json=body, timeout=REQUEST_TIMEOUT_S) as reply:
        assert reply.status_code == 200
        events = (line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: "))
        first = next(events)
        assert "choices" in json.loads(first)
        killed = kill_stage(served, index)
        last = [event for event in events if event != "[DONE]"][-1]
    code = json.loads(last).get("error", {}).get("code")
    return killed, Answer(reply.status_code, reply.headers.get("retry-after"), code, time.monotonic() - killed)


@pytest.mark.parametrize(
    ("index", "kill_under"),
    [
        pytest.param(1, killed_under_a_whole_request, id="the last stage killed under a request: 503, then back"),
        pytest.param(0, killed_under_a_whole_request, id="the first stage killed under a request: 503, then back"),
        pytest.param(1, killed_under_a_stream, id="a stage killed under a stream: the stream ends with the error"),
    ],
)
def test_a_killed_stage_is_back_serving_within_30_s_and_no_request_hangs(
    served: Served, index: int, kill_under: Callable[[Served, int], tuple[float, Answer]]
) -> None:
    wait_until(
        lambda: httpx.get(f"{served.root}/readyz", timeout=REQUEST_TIMEOUT_S).status_code == 200,
        what="serve to be ready (after the previous case)",
        timeout_s=BACK_WITHIN_S,
    )
    ports = [stage_port(served, 0), stage_port(served, 1)]
    terms = [accepted_term(port) for port in ports]
    restarts = served.output.text().count(f"stage {index} restarted")

    killed, in_flight = kill_under(served, index)

    assert in_flight.seconds < FAILS_WITHIN_S, f"the request running at the kill took {in_flight.seconds:.1f} s"
    assert in_flight.code == "service_unavailable", in_flight
    if kill_under is killed_under_a_whole_request:
        assert (in_flight.status, in_flight.retry_after) == (503, "1"), in_flight
    while (answer := ask_whole(served, max_tokens=4)).status != 200:  # a slow answer raises ReadTimeout: a hang
        assert (answer.status, answer.retry_after) == (503, "1"), answer
        assert answer.code == "service_unavailable", answer
        assert time.monotonic() - killed < BACK_WITHIN_S, f"not serving {BACK_WITHIN_S:.0f} s after the kill"
        time.sleep(0.2)
    print(f"stage {index}: serving again {time.monotonic() - killed:.1f} s after SIGKILL")
    assert httpx.get(f"{served.root}/readyz", timeout=REQUEST_TIMEOUT_S).status_code == 200
    assert served.output.text().count(f"stage {index} restarted on port {ports[index]}") == restarts + 1
    after = [accepted_term(port) for port in ports]
    assert all(now > then for now, then in zip(after, terms, strict=True)), f"terms {terms}, then {after}"


def kill_it_again_when_back(served: Served, index: int, port: int) -> None:
    line = f"stage {index} restarted on port {port}"
    assert served.output.wait_for(lambda seen: seen.startswith(line), timeout=BACK_WITHIN_S), served.output.text()
    kill_stage(served, index)


def take_its_port(served: Served, index: int, port: int) -> None:
    """Listen on the dead stage's port first, so its restart cannot bind it (SO_REUSEADDR: the port may still have
    connections in TIME_WAIT; without SO_REUSEPORT, which gRPC sets, no second listener may join)."""
    taker = socket.socket()
    taker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    deadline = time.monotonic() + 5
    while True:
        try:
            taker.bind(("127.0.0.1", port))
            break
        except OSError:
            assert time.monotonic() < deadline, "the killed stage's port was released"
            time.sleep(0.01)
    taker.listen()
    served.output.wait_for(lambda seen: seen.startswith("strata serve: "), timeout=EXITS_WITHIN_S)
    taker.close()


@pytest.mark.parametrize(
    ("index", "then", "cause", "in_log"),
    [
        pytest.param(
            1,
            kill_it_again_when_back,
            "died 2 times within 60 s, the last time was killed by SIGKILL",
            "stage 1 loaded layers [2, 4)",
            id="a stage killed again once it is back",
        ),
        pytest.param(
            0,
            take_its_port,
            "died 2 times within 60 s, the last time did not start again (it exited with status 1)",
            "Failed to bind to address 127.0.0.1:{port}",
            id="a stage that cannot start again: its port is taken",
        ),
    ],
)
def test_a_stage_that_keeps_dying_ends_serve_with_its_last_error(
    qwen2_model: Path, index: int, then: Callable[[Served, int, int], None], cause: str, in_log: str
) -> None:
    args = ("--stages", "2", "--process-per-stage", "--parallel", "1", "--context", "256", "--stage-restarts", "1")
    with strata_serve(str(qwen2_model), *args) as served:
        tree = process_tree(served.process.pid)
        port = stage_port(served, index)
        kill_stage(served, index)
        then(served, index, port)
        served.process.wait(EXITS_WITHIN_S)
        output = served.output.text()
    assert served.process.returncode == 1, output
    assert f"strata serve: stage {index} {cause}; giving up. The end of its log (" in output
    assert in_log.format(port=port) in output.rpartition("strata serve: ")[2], "its log's last lines are printed"
    assert living(pids=set(tree), groups=set(tree.values())) == set(), "no stage is left running"
