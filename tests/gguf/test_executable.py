"""One answer to "can Strata's stages run this model?": `strata inspect` prints it, and the stage worker's loader,
`strata serve` and the operator refuse with the same reason (their own tests show them doing so)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from strata.cli import main
from strata.gguf import NotExecutableError, check_executable, describe, not_executable_reason
from strata.gguf.architectures import ARCHITECTURES
from strata.gguf.executable import EXECUTABLE_ARCHITECTURES, LOADABLE_TYPES
from strata.gguf.header import read_header
from strata.gguf.sources import FileSource
from strata.gguf.testmodels import LARGE_SHAPES, write_header_only_model

# Plain integer tensors: gguf-py passes them through, but they hold no weights a stage reads.
_INTEGER_TYPES = {GGMLQuantizationType.I8, GGMLQuantizationType.I16, GGMLQuantizationType.I32, GGMLQuantizationType.I64}
FALCON = (
    "architecture 'falcon' is not one the stage worker runs (gemma2, gemma3, llama, mistral, phi3, qwen2, qwen3, "
    "qwen3moe)"
)


@pytest.mark.parametrize(
    ("architecture", "reason"),
    [
        pytest.param("llama", None, id="llama runs"),
        pytest.param("qwen3", None, id="qwen3 runs"),
        pytest.param("gemma3", None, id="gemma3 runs"),
        pytest.param("phi3", None, id="phi3 runs"),
        pytest.param("qwen3moe", None, id="a mixture of experts runs"),
        pytest.param("falcon", FALCON, id="falcon does not, and the reason lists what does"),
        pytest.param("qwen2moe", "architecture 'qwen2moe' is not one", id="a mixture the table lacks does not"),
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


def _file_with(tmp_path: Path, *, tokenizer: str | None = None, tensor_type: GGMLQuantizationType | None = None) -> str:
    """A generated llama header with its tokenizer model or its first block's q tensor type changed."""
    path = write_header_only_model(tmp_path / "llama.gguf", shape=LARGE_SHAPES["llama3-8b"]).path
    header = read_header(FileSource(path))
    metadata = dict(header.metadata)
    if tokenizer is not None:
        metadata["tokenizer.ggml.model"] = tokenizer
    tensors = tuple(
        dataclasses.replace(t, ggml_type=tensor_type) if tensor_type and t.name == "blk.0.attn_q.weight" else t
        for t in header.tensors
    )
    reason = describe(dataclasses.replace(header, metadata=metadata, tensors=tensors)).not_executable_reason
    return reason or ""


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        pytest.param({}, "", id="the generated llama runs"),
        pytest.param(
            {"tokenizer": "bert"},
            "tokenizer.ggml.model 'bert' is not a tokenizer the gateway builds (gpt2, llama)",
            id="a tokenizer the gateway does not build",
        ),
        pytest.param(
            {"tensor_type": GGMLQuantizationType.Q8_K},
            "tensor blk.0.attn_q.weight is of type Q8_K, which no stage loads",
            id="a tensor type no stage loads",
        ),
        pytest.param({"tensor_type": GGMLQuantizationType.IQ4_XS}, "", id="a type the stages dequantise at load"),
    ],
)
def test_the_shared_check_reads_the_tokenizer_and_tensor_types(
    tmp_path: Path, change: dict[str, Any], reason: str
) -> None:
    assert _file_with(tmp_path, **change) == reason


def test_the_loadable_types_are_those_a_stage_reads_as_stored_or_gguf_py_dequantises() -> None:
    """Each type gguf-py dequantises is in the set, and each one it cannot is not (one block of zero bytes)."""
    as_stored = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
    dequantised = set()
    for ggml_type in GGMLQuantizationType:
        _, block_bytes = GGML_QUANT_SIZES[ggml_type]
        try:
            dequantize(np.zeros((1, block_bytes), dtype=np.uint8), ggml_type)
        except NotImplementedError:
            continue
        dequantised.add(ggml_type)
    assert (dequantised | as_stored) - {GGMLQuantizationType.F64} - _INTEGER_TYPES == LOADABLE_TYPES
