"""Pipelines of 1, 2 and 3 stages on loopback gRPC compute what HF transformers computes from the same GGUF.

Two requests share every step (continuous batching) and prefill in chunks of 8, so the comparison covers slot
isolation, chunk boundaries and the activations' trip between stages, not only the layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from strata.gguf.model import CacheType
from strata.rpc.v1 import stage_pb2
from strata.stage_worker.client import Pipeline, Request
from strata_testbed.hf_reference import greedy, hf_reference
from strata_testbed.pipelines import local_pipeline

PROMPTS = (
    (1, 17, 200, 3, 45, 99, 12, 7, 250, 31, 64, 128, 5, 77, 190, 2, 33, 81, 140, 9),
    (4, 8, 15, 16, 23, 42, 108, 99, 250, 1, 2, 3, 200),
)
NEW_TOKENS = 32
SPANS = {
    1: [(0, 3)],
    2: [(0, 2), (2, 3)],
    3: [(0, 1), (1, 2), (2, 3)],
}
FENCE = stage_pb2.Fence(term=1, holder="test-coordinator", lease_uid="lease-1")
# The llama family here; Gemma (tests/stage_worker/test_gemma.py) and experts (test_experts.py) have tests of their own.
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class Expected:
    prompt_logits: torch.Tensor  # [T, vocab]
    greedy: list[int]
    greedy_logits: torch.Tensor  # [T + NEW_TOKENS, vocab], teacher-forced over prompt + greedy tokens


@pytest.fixture(scope="session")
def expected(tiny_models: dict[str, Path]) -> dict[tuple[str, int], Expected]:
    """HF's logits and greedy continuation for each architecture and prompt."""
    table = {}
    for architecture in ARCHITECTURES:
        model = hf_reference(tiny_models[architecture])
        with torch.inference_mode():
            for index, prompt in enumerate(PROMPTS):
                continuation = greedy(model, prompt, NEW_TOKENS)
                logits = model(torch.tensor([[*prompt, *continuation]])).logits[0]
                table[architecture, index] = Expected(
                    prompt_logits=logits[: len(prompt)], greedy=continuation, greedy_logits=logits
                )
    return table


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest, over positions, of ||ours - reference|| / ||reference||."""
    return float(((ours - reference).norm(dim=-1) / reference.norm(dim=-1)).max())


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize(
    "stages",
    [
        pytest.param(1, id="one stage"),
        pytest.param(2, id="two stages"),
        pytest.param(3, id="three stages"),
    ],
)
def test_logits_and_greedy_continuations_match_hf(
    tiny_models: dict[str, Path], expected: dict[tuple[str, int], Expected], architecture: str, stages: int
) -> None:
    with local_pipeline(tiny_models[architecture], SPANS[stages]) as running:
        pipeline = Pipeline(f"127.0.0.1:{running[0].port}", fence=FENCE)
        pipeline.claim()
        requests = [Request(prompt=p, max_tokens=NEW_TOKENS, prompt_logits=True) for p in PROMPTS]
        completions = pipeline.generate(requests, slots=2, prefill_chunk=8)
    for index, completion in enumerate(completions):
        reference = expected[architecture, index]
        assert relative_error(torch.cat(completion.prompt_logits), reference.prompt_logits) <= 1e-4
        assert completion.tokens == reference.greedy


# q8_0 rounds K and V to 8 bits per value with one scale per 32; on these models the logits move by about 1% of
# their norm (measured 0.7-1.1%), so 3% leaves room without hiding a real fault (a wrong rotation is >50%).
Q8_0_RELATIVE_TOLERANCE = 0.03
Q8_0_TOP_TOKEN_SHARE = 0.95


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_q8_0_cache_keeps_the_top_token_at_nearly_every_position(
    tiny_models: dict[str, Path], expected: dict[tuple[str, int], Expected], architecture: str
) -> None:
    with local_pipeline(tiny_models[architecture], SPANS[3], cache_type=CacheType.Q8_0) as running:
        pipeline = Pipeline(f"127.0.0.1:{running[0].port}", fence=FENCE)
        pipeline.claim()
        sequences = [tuple(p) + tuple(expected[architecture, i].greedy) for i, p in enumerate(PROMPTS)]
        requests = [Request(prompt=s, max_tokens=1, prompt_logits=True) for s in sequences]
        completions = pipeline.generate(requests, slots=2, prefill_chunk=8)
    matches = total = 0
    for index, completion in enumerate(completions):
        ours = torch.cat(completion.prompt_logits)
        reference = expected[architecture, index].greedy_logits
        assert relative_error(ours, reference) <= Q8_0_RELATIVE_TOLERANCE
        matches += int((ours.argmax(-1) == reference.argmax(-1)).sum())
        total += ours.shape[0]
    assert matches / total >= Q8_0_TOP_TOKEN_SHARE
