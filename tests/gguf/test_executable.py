"""One answer to "can Strata's stages run this model?": `strata inspect` prints it, and the stage worker's loader,
`strata serve` and the operator refuse with the same reason (their own tests show them doing so)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from strata.cli import main
from strata.gguf import NotExecutableError, check_executable, not_executable_reason
from strata.gguf.architectures import ARCHITECTURES
from strata.gguf.executable import EXECUTABLE_ARCHITECTURES
from strata.gguf.testmodels import LARGE_SHAPES, write_header_only_model

FALCON = "architecture 'falcon' is not one the stage worker runs (gemma2, gemma3, llama, mistral, phi3, qwen2, qwen3)"


@pytest.mark.parametrize(
    ("architecture", "reason"),
    [
        pytest.param("llama", None, id="llama runs"),
        pytest.param("qwen3", None, id="qwen3 runs"),
        pytest.param("gemma3", None, id="gemma3 runs"),
        pytest.param("phi3", None, id="phi3 runs"),
        pytest.param("falcon", FALCON, id="falcon does not, and the reason lists what does"),
        pytest.param("qwen3moe", "architecture 'qwen3moe' is not one", id="a mixture of experts does not"),
    ],
)
def test_the_shared_check_says_why_a_model_cannot_run(architecture: str, reason: str | None) -> None:
    found = not_executable_reason(architecture)
    if reason is None:
        assert found is None
        check_executable(architecture)
        return
    assert found is not None
    assert found.startswith(reason)
    with pytest.raises(NotExecutableError, match=re.escape(found)):
        check_executable(architecture)


def test_the_stage_worker_runs_exactly_the_architectures_the_check_accepts() -> None:
    assert set(ARCHITECTURES) == EXECUTABLE_ARCHITECTURES


@pytest.mark.parametrize(
    ("args", "shown"),
    [
        pytest.param([], f"falcon (not executable by Strata: {FALCON})", id="the table gives the reason"),
        pytest.param(["--json"], FALCON, id="the JSON gives the reason"),
    ],
)
def test_inspect_says_why_a_model_is_not_executable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], shown: str
) -> None:
    shape = dataclasses.replace(LARGE_SHAPES["llama3-8b"], architecture="falcon", block_count=6)
    path = write_header_only_model(tmp_path / "falcon.gguf", shape=shape).path
    assert main(["inspect", str(path), *args]) == 0
    out = capsys.readouterr().out
    if args:
        report = json.loads(out)
        assert (report["executable"], report["not_executable_reason"]) == (False, shown)
    else:
        assert any(line.split(None, 1)[1:] == [shown] for line in out.splitlines()), out
