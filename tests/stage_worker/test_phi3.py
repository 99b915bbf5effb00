"""Generated Phi-3 models (fused qkv and gate/up matrices, as llama.cpp writes them) served by one and two stages
compute what HF transformers' Phi3ForCausalLM computes from the same file, in f32: with full rotation (Phi-3) and
with half of each head rotated and a tied output (Phi-4 mini's shape).

HF's GGUF loader reads no rope.dimension_count for phi3, so the partial case states HF's partial_rotary_factor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from strata.gguf.testmodels import SMALL_SHAPES, ModelShape, write_test_model
from strata.rpc.v1 import stage_pb2
from strata.stage_worker.client import Pipeline, Request
from strata_testbed.hf_reference import greedy, hf_reference
from strata_testbed.pipelines import local_pipeline

PROMPTS = (
    (1, 17, 200, 3, 45, 99, 12, 7, 250, 31, 64, 128, 5, 77, 190, 2, 33, 81, 140, 9),
    (4, 8, 15, 16, 23, 42, 108, 99, 250, 1, 2, 3, 200),
)
NEW_TOKENS = 12
FENCE = stage_pb2.Fence(term=1, holder="test-coordinator", lease_uid="lease-1")
PHI3 = SMALL_SHAPES["phi3"]


@dataclass(frozen=True)
class Case:
    shape: ModelShape
    spans: list[tuple[int, int]]
    hf_rope: dict[str, Any] | None = None


PARTIAL = dataclasses.replace(PHI3, rope_dim=PHI3.head_dim // 2, tied_output=True)
PARTIAL_ROPE = {"rope_type": "default", "rope_theta": PHI3.rope_freq_base, "partial_rotary_factor": 0.5}
CASES = {
    "phi3 on one stage": Case(PHI3, [(0, 2)]),
    "phi3 on two stages": Case(PHI3, [(0, 1), (1, 2)]),
    "half of each head rotated, tied output, on one stage": Case(PARTIAL, [(0, 2)], PARTIAL_ROPE),
    "half of each head rotated, tied output, on two stages": Case(PARTIAL, [(0, 1), (1, 2)], PARTIAL_ROPE),
}


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float(((ours - reference).norm(dim=-1) / reference.norm(dim=-1)).max())


@pytest.mark.parametrize("name", CASES)
def test_logits_and_greedy_continuations_match_hf_phi3(tmp_path: Path, name: str) -> None:
    case = CASES[name]
    path = write_test_model(tmp_path / "phi3.gguf", architecture="phi3", shape=case.shape).path
    reference = hf_reference(path, rope_parameters=case.hf_rope)
    assert type(reference).__name__ == "Phi3ForCausalLM"
    with local_pipeline(path, case.spans) as running:
        pipeline = Pipeline(f"127.0.0.1:{running[0].port}", fence=FENCE)
        pipeline.claim()
        requests = [Request(prompt=p, max_tokens=NEW_TOKENS, prompt_logits=True) for p in PROMPTS]
        completions = pipeline.generate(requests, slots=2, prefill_chunk=8)
    with torch.inference_mode():
        for prompt, completion in zip(PROMPTS, completions, strict=True):
            expected = reference(torch.tensor([prompt])).logits[0]
            assert relative_error(torch.cat(completion.prompt_logits), expected) <= 1e-4
            assert completion.tokens == greedy(reference, prompt, NEW_TOKENS)


def test_the_partial_case_rotates_part_of_each_head(tmp_path: Path) -> None:
    """HF rotating whole heads computes another model from the partial file: the cases above test the width."""
    path = write_test_model(tmp_path / "phi3.gguf", architecture="phi3", shape=PARTIAL).path
    with torch.inference_mode():
        partial = hf_reference(path, rope_parameters=PARTIAL_ROPE)(torch.tensor([PROMPTS[0]])).logits[0]
        whole = hf_reference(path)(torch.tensor([PROMPTS[0]])).logits[0]
    assert relative_error(whole, partial) > 1e-2
