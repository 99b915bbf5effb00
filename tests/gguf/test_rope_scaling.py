"""A RoPE scaling the stages do not apply is refused by name, everywhere a model is checked before it runs: the header's
description (so `strata inspect`, `strata serve` and the operator), and the stage worker's loader. The scalings they
do apply are accepted by the same reading (tests/stage_worker/test_rope_scaling.py checks their numbers against HF).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from strata.cli import main
from strata.gguf import NotExecutableError, check_executable, describe, read_header
from strata.gguf.sources import open_source
from strata.gguf.testmodels import SMALL_SHAPES, write_test_model
from strata.stage_worker.errors import ModelFileError
from strata_testbed.stages import load_spans

# architecture, what the file states under {arch}.rope., rope_freqs.weight values -> the refusal, or None: accepted
REFUSED: dict[str, tuple[str, tuple[tuple[str, str | float | int], ...], tuple[float, ...], str]] = {
    "YaRN names the type": (
        "qwen2",
        (("scaling.type", "yarn"), ("scaling.factor", 4.0), ("scaling.original_context_length", 32768)),
        (),
        "qwen2.rope.scaling.type is 'yarn': the stage worker applies none and linear RoPE scaling",
    ),
    "LongRoPE names the type": (
        "llama",
        (("scaling.type", "longrope"), ("scaling.attn_factor", 1.19)),
        (),
        "llama.rope.scaling.type is 'longrope'",
    ),
    "an attention factor with linear scaling names the key": (
        "llama",
        (("scaling.type", "linear"), ("scaling.factor", 2.0), ("scaling.attn_factor", 0.5)),
        (),
        "llama.rope.scaling.attn_factor is 0.5, which the stage worker's RoPE does not apply",
    ),
    "a YaRN key under linear scaling names the key": (
        "llama",
        (("scaling.factor", 2.0), ("scaling.yarn_beta_fast", 32.0)),
        (),
        "llama.rope.scaling.yarn_beta_fast is 32.0",
    ),
    "no scaling with a factor contradicts itself": (
        "llama",
        (("scaling.type", "none"), ("scaling.factor", 4.0)),
        (),
        "llama.rope.scaling.type is 'none' but llama.rope.scaling.factor is 4",
    ),
    "rope_freqs in an architecture that does not read it": (
        "qwen2",
        (),
        (1.0,) * 16,
        "the file has rope_freqs.weight, which qwen2 models do not apply",
    ),
}
ACCEPTED: dict[str, tuple[str, tuple[tuple[str, str | float | int], ...]]] = {
    "no scaling stated": ("llama", ()),
    "no scaling, stated": ("llama", (("scaling.type", "none"),)),
    "linear, with the trained context and a neutral attention factor": (
        "qwen3",
        (
            ("scaling.type", "linear"),
            ("scaling.factor", 2.0),
            ("scaling.original_context_length", 4096),
            ("scaling.attn_factor", 1.0),
        ),
    ),
}


def written(
    tmp_path: Path, architecture: str, keys: tuple[tuple[str, str | float | int], ...], freqs: tuple[float, ...] = ()
) -> Path:
    shape = dataclasses.replace(SMALL_SHAPES[architecture], rope_keys=keys, rope_freqs=freqs)
    return write_test_model(tmp_path / "model.gguf", architecture=architecture, shape=shape).path


def load_whole(path: Path) -> None:
    load_spans(path)


@pytest.mark.parametrize("case", REFUSED)
def test_a_scaling_the_stages_do_not_apply_is_refused_by_name(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    architecture, keys, freqs, message = REFUSED[case]
    path = written(tmp_path, architecture, keys, freqs)
    source = open_source(str(path))
    info = describe(read_header(source))
    source.close()
    assert info.unsupported is not None
    assert info.unsupported.startswith(message)
    assert not info.executable
    with pytest.raises(NotExecutableError, match=re.escape(message)):
        check_executable(info.architecture, unsupported=info.unsupported)
    assert main(["inspect", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["executable"], report["not_executable_reason"]) == (False, info.unsupported)
    with pytest.raises(ModelFileError, match=re.escape(message)):
        load_whole(path)


@pytest.mark.parametrize("case", ACCEPTED)
def test_the_scalings_the_stages_apply_are_accepted(case: str, tmp_path: Path) -> None:
    architecture, keys = ACCEPTED[case]
    path = written(tmp_path, architecture, keys)
    source = open_source(str(path))
    info = describe(read_header(source))
    source.close()
    assert (info.unsupported, info.executable) == (None, True)
    load_whole(path)
