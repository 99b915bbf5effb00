"""`strata stage-worker` as the operator runs it: separate processes configured by STRATA_* variables, the first
stage reading its tensors from an HTTP server by Range requests, flags overriding the environment."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from strata.rpc.v1 import stage_pb2
from strata.stage_worker.client import Pipeline, Request, wait_loaded
from strata.stage_worker.command import STOP_DEADLINE_S, resolve
from strata_testbed.pipelines import local_pipeline
from strata_testbed.range_server import serve_directory

PROMPT = (3, 1, 4, 1, 5, 9, 2, 6)


@contextmanager
def stage_ports(env: dict[str, str], *flags: str, stages: int = 1) -> Iterator[list[int]]:
    """A `strata stage-worker` process; the port of each of its stages, first to last. It must end by itself, with
    status 0, after SIGTERM; its log is in the failure when it does not."""
    # The log goes to a file, not a pipe: a log no one reads cannot fill a pipe and block the process.
    with tempfile.TemporaryFile(mode="w+") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "strata.cli", "stage-worker", "--listen", "127.0.0.1:0", *flags],
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        try:
            assert process.stdout is not None
            ports = []
            for index in range(stages):
                line = process.stdout.readline()
                match = re.search(r"listening on port (\d+)", line)
                assert match, f"stage {index} of the process printed {line!r}"
                ports.append(int(match.group(1)))
            yield ports
        finally:
            process.terminate()
            try:
                status = process.wait(timeout=STOP_DEADLINE_S + 10)
            except subprocess.TimeoutExpired:
                process.kill()
                status = process.wait()
            log.seek(0)
            assert status == 0, f"the process ended with status {status} after SIGTERM; its log:\n{log.read()[-8000:]}"


@contextmanager
def stage_process(env: dict[str, str], *flags: str) -> Iterator[int]:
    with stage_ports(env, *flags) as ports:
        yield ports[0]


def test_two_stage_processes_configured_by_the_environment_serve_the_same_tokens(
    tiny_models: dict[str, Path],
) -> None:
    path = tiny_models["qwen3"]
    common = {
        "STRATA_CONTEXT": "64",
        "STRATA_PARALLEL": "2",
        "STRATA_CACHE_TYPE_K": "f32",
        "STRATA_CACHE_TYPE_V": "f32",
    }
    with (
        serve_directory(path.parent) as http,
        stage_process({**common, "STRATA_STAGE_INDEX": "1", "STRATA_LAYER_START": "2", "STRATA_LAYER_END": "3",
                       "STRATA_MODEL_URL": str(path)}) as last_port,
        stage_process({**common, "STRATA_STAGE_INDEX": "0", "STRATA_LAYER_START": "0", "STRATA_LAYER_END": "2",
                       "STRATA_MODEL_URL": f"{http.url}/{path.name}",
                       "STRATA_NEXT_STAGE": f"127.0.0.1:{last_port}"}) as first_port,
    ):  # fmt: skip
        pipeline = Pipeline(f"127.0.0.1:{first_port}", fence=stage_pb2.Fence(term=1, holder="a"))
        wait_loaded(f"127.0.0.1:{last_port}", timeout_s=60)
        status = wait_loaded(f"127.0.0.1:{first_port}", timeout_s=60)
        pipeline.claim()
        tokens = pipeline.generate([Request(prompt=PROMPT, max_tokens=8)], slots=2)[0].tokens
        assert all(r.get("range") for r in http.log.requests)
        assert status.bytes_loaded == status.bytes_total < path.stat().st_size
    with local_pipeline(path, [(0, 3)]) as stages:
        reference = Pipeline(f"127.0.0.1:{stages[0].port}", fence=stage_pb2.Fence(term=1, holder="a"))
        assert tokens == reference.generate([Request(prompt=PROMPT, max_tokens=8)], slots=1)[0].tokens


def test_one_process_split_into_two_stages_serves_the_same_tokens_and_hands_activations_over(
    tiny_models: dict[str, Path],
) -> None:
    path = tiny_models["qwen3"]
    env = {
        "STRATA_CONTEXT": "64", "STRATA_PARALLEL": "2", "STRATA_CACHE_TYPE_K": "f32", "STRATA_CACHE_TYPE_V": "f32",
        "STRATA_STAGE_INDEX": "0", "STRATA_LAYER_START": "0", "STRATA_LAYER_END": "3", "STRATA_SPLIT_AT": "2",
        "STRATA_MODEL_URL": str(path),
    }  # fmt: skip
    with stage_ports(env, stages=2) as (first_port, last_port):
        first, last = (wait_loaded(f"127.0.0.1:{port}", timeout_s=60) for port in (first_port, last_port))
        pipeline = Pipeline(f"127.0.0.1:{first_port}", fence=stage_pb2.Fence(term=1, holder="a"))
        pipeline.claim()
        tokens = pipeline.generate([Request(prompt=PROMPT, max_tokens=8)], slots=2)[0].tokens
        after = wait_loaded(f"127.0.0.1:{last_port}", timeout_s=10)
    assert (first.stage_index, first.layer_start, first.layer_end) == (0, 0, 2)
    assert (last.stage_index, last.layer_start, last.layer_end) == (1, 2, 3)
    assert after.activations_in_process == 8
    assert after.activations_shared == after.activations_inline == 0
    with local_pipeline(path, [(0, 3)]) as stages:
        reference = Pipeline(f"127.0.0.1:{stages[0].port}", fence=stage_pb2.Fence(term=1, holder="a"))
        assert tokens == reference.generate([Request(prompt=PROMPT, max_tokens=8)], slots=1)[0].tokens


def test_a_split_the_process_cannot_serve_is_refused_naming_it() -> None:
    env = {"STRATA_LAYER_START": "0", "STRATA_LAYER_END": "2", "STRATA_MODEL_URL": "m.gguf", "STRATA_CONTEXT": "64"}
    result = subprocess.run(
        [sys.executable, "-m", "strata.cli", "stage-worker", "--listen", "127.0.0.1:7001", "--split-at", "1"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "strata stage-worker: listen address 127.0.0.1:7001 serves one stage; 2 stages in one process" in (
        result.stderr
    ), result.stderr


@pytest.mark.parametrize(
    ("flags", "env", "expected"),
    [
        pytest.param(["--context", "512"], {"STRATA_CONTEXT": "4096"}, 512, id="a flag overrides the environment"),
        pytest.param([], {"STRATA_CONTEXT": "4096"}, 4096, id="the environment is used without a flag"),
    ],
)
def test_settings_come_from_flags_then_the_environment(flags: list[str], env: dict[str, str], expected: int) -> None:
    from strata.cli import build_parser

    base = {"STRATA_LAYER_START": "0", "STRATA_LAYER_END": "2", "STRATA_MODEL_URL": "m.gguf"}
    args: argparse.Namespace = build_parser().parse_args(["stage-worker", *flags])
    values = resolve(args, {**base, **env})
    assert values["context"] == expected
    assert values["cache_type_k"] == "q8_0"


def test_a_missing_required_setting_names_the_flag_and_the_variable() -> None:
    from strata.cli import build_parser

    args = build_parser().parse_args(["stage-worker"])
    with pytest.raises(SystemExit, match="--layer-start or STRATA_LAYER_START"):
        resolve(args, {})
