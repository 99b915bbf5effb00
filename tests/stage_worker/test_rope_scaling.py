"""A file's RoPE scaling, as HF transformers computes it: linear scaling (stated, defaulted, under the old key, on a
"neox" architecture, and on Gemma 3's global layer only) and Llama 3.1's factors in rope_freqs.weight, served by one
and two stages in f32.

HF's GGUF loader reads no scaling from a file, so each case states the HF rope parameters its file was written from
(for Llama 3.1, the parameters llama.cpp's converter folded into the factors). The prompts run past the context the
scaled frequencies were tuned at, and each case first checks that the scaling changes HF's logits by far more than
the tolerance, so a stage that ignored it would fail.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from strata.gguf.testmodels import SMALL_SHAPES, write_test_model
from strata.gguf.testmodels.rope import llama3_rope_factors
from strata.rpc.v1 import stage_pb2
from strata.stage_worker.client import Pipeline, Request
from strata_testbed.hf_reference import greedy, hf_reference
from strata_testbed.pipelines import local_pipeline

PROMPT = (1, 17, 200, 3, 45, 99, 12, 7, 250, 31, 64, 128, 5, 77, 190, 2, 33, 81, 140, 9, 4, 8, 15, 16, 23, 42)
NEW_TOKENS = 8
FENCE = stage_pb2.Fence(term=1, holder="test-coordinator", lease_uid="lease-1")
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@dataclass(frozen=True)
class Case:
    architecture: str
    rope_keys: tuple[tuple[str, str | float | int], ...]
    hf_rope: dict[str, Any]  # HF's rope_parameters for the same model
    rope_freqs: tuple[float, ...] = ()


def _theta(architecture: str) -> float:
    return SMALL_SHAPES[architecture].rope_freq_base


def _linear(architecture: str, factor: float) -> dict[str, Any]:
    return {"rope_type": "linear", "factor": factor, "rope_theta": _theta(architecture)}


CASES = {
    "linear scaling by 4 on llama": Case(
        "llama", (("scaling.type", "linear"), ("scaling.factor", 4.0)), _linear("llama", 4.0)
    ),
    "a factor with no type is linear, as llama.cpp reads it": Case(
        "llama", (("scaling.factor", 4.0),), _linear("llama", 4.0)
    ),
    "the old rope.scale_linear key": Case("llama", (("scale_linear", 2.0),), _linear("llama", 2.0)),
    "linear scaling on qwen2's neox rotation": Case(
        "qwen2", (("scaling.type", "linear"), ("scaling.factor", 3.0)), _linear("qwen2", 3.0)
    ),
    "Llama 3.1's factors in rope_freqs.weight": Case(
        "llama",
        (),
        {"rope_type": "llama3", "rope_theta": _theta("llama"), **LLAMA3},
        rope_freqs=llama3_rope_factors(
            rope_dim=SMALL_SHAPES["llama"].head_dim,
            base=_theta("llama"),
            factor=LLAMA3["factor"],
            low_freq_factor=LLAMA3["low_freq_factor"],
            high_freq_factor=LLAMA3["high_freq_factor"],
            original_context=int(LLAMA3["original_max_position_embeddings"]),
        ),
    ),
    "linear scaling on gemma3's global layer, not its sliding ones": Case(
        "gemma3",
        (("scaling.type", "linear"), ("scaling.factor", 8.0)),
        {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": _linear("gemma3", 8.0),
        },
    ),
}
SPANS = {"one stage": 1, "two stages": 2}


def write_case(folder: Path, name: str, case: Case) -> Path:
    shape = dataclasses.replace(SMALL_SHAPES[case.architecture], rope_keys=case.rope_keys, rope_freqs=case.rope_freqs)
    return write_test_model(folder / f"{name.replace(' ', '-')}.gguf", architecture=case.architecture, shape=shape).path


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float(((ours - reference).norm(dim=-1) / reference.norm(dim=-1)).max())


def test_the_llama3_factors_cover_all_three_regimes() -> None:
    """Kept, blended and divided by the factor: otherwise the case above would not test the blend."""
    factors = CASES["Llama 3.1's factors in rope_freqs.weight"].rope_freqs
    assert 1.0 in factors
    assert LLAMA3["factor"] in factors
    assert any(1.0 < f < LLAMA3["factor"] for f in factors)


@pytest.mark.parametrize("stages", SPANS.values(), ids=SPANS.keys())
@pytest.mark.parametrize("name", CASES)
def test_scaled_rope_matches_hf(tmp_path: Path, name: str, stages: int) -> None:
    case = CASES[name]
    path = write_case(tmp_path, name, case)
    scaled, unscaled = hf_reference(path, rope_parameters=case.hf_rope), hf_reference(path)
    with torch.inference_mode():
        expected = scaled(torch.tensor([PROMPT])).logits[0]
        assert relative_error(unscaled(torch.tensor([PROMPT])).logits[0], expected) > 1e-2, "the scaling shows"
    continuation = greedy(scaled, PROMPT, NEW_TOKENS)
    n_layer = SMALL_SHAPES[case.architecture].block_count
    spans = [(0, n_layer)] if stages == 1 else [(0, n_layer // 2), (n_layer // 2, n_layer)]
    with local_pipeline(path, spans, context=1024) as running:
        pipeline = Pipeline(f"127.0.0.1:{running[0].port}", fence=FENCE)
        pipeline.claim()
        (completion,) = pipeline.generate(
            [Request(prompt=PROMPT, max_tokens=NEW_TOKENS, prompt_logits=True)], slots=1, prefill_chunk=8
        )
    assert relative_error(torch.cat(completion.prompt_logits), expected) <= 1e-4
    assert completion.tokens == continuation
