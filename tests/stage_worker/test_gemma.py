"""Generated Gemma 2 and Gemma 3 models, served by pipelines of 1, 2 and 3 stages, compute what HF transformers
computes from the same GGUF file.

The models' windows (8 positions) are far shorter than the prompts, which prefill in chunks of 8 across two slots,
so the comparison covers the window's mask in the prefill path, in the pool's read of chunks after cached positions
and in decode, with the sliding layers' cells reused as positions leave the window; gemma3's seven layers include
its global layer (5), which rotates with another RoPE base.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from strata.gguf.testmodels import SMALL_SHAPES, write_test_model
from strata.rpc.v1 import stage_pb2
from strata.stage_worker.client import Pipeline, Request
from strata_testbed.hf_reference import greedy, hf_reference
from strata_testbed.pipelines import local_pipeline

PROMPTS = (
    (1, 17, 200, 3, 45, 99, 12, 7, 250, 31, 64, 128, 5, 77, 190, 2, 33, 81, 140, 9),
    (4, 8, 15, 16, 23, 42, 108, 99, 250, 1, 2, 3, 200),
)
NEW_TOKENS = 16
# Longer than the sliding layers' cells (window * 2 slots + 512), so those layers keep a space of their own.
CONTEXT = 1024
FENCE = stage_pb2.Fence(term=1, holder="test-coordinator", lease_uid="lease-1")


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest, over positions, of ||ours - reference|| / ||reference||."""
    return float(((ours - reference).norm(dim=-1) / reference.norm(dim=-1)).max())


@dataclass(frozen=True)
class Case:
    architecture: str
    spans: list[tuple[int, int]]


CASES = [
    pytest.param(Case("gemma3", [(0, 7)]), id="gemma3 on one stage"),
    pytest.param(Case("gemma3", [(0, 4), (4, 7)]), id="gemma3 on two stages"),
    pytest.param(Case("gemma3", [(0, 2), (2, 5), (5, 7)]), id="gemma3 on three stages, the global layer last"),
    pytest.param(Case("gemma2", [(0, 3)]), id="gemma2 on one stage"),
    pytest.param(Case("gemma2", [(0, 2), (2, 3)]), id="gemma2 on two stages"),
    pytest.param(Case("gemma2", [(0, 1), (1, 2), (2, 3)]), id="gemma2 on three stages"),
]


@pytest.fixture(scope="module")
def gemma_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gemma")
    return {arch: write_test_model(folder / f"{arch}.gguf", architecture=arch).path for arch in ("gemma2", "gemma3")}


@pytest.fixture(scope="module")
def expected(gemma_models: dict[str, Path]) -> dict[tuple[str, int], tuple[torch.Tensor, list[int]]]:
    """HF's prompt logits and greedy continuation, per architecture and prompt."""
    table = {}
    for architecture, path in gemma_models.items():
        model = hf_reference(path)
        with torch.inference_mode():
            for index, prompt in enumerate(PROMPTS):
                table[architecture, index] = (
                    model(torch.tensor([prompt])).logits[0],
                    greedy(model, prompt, NEW_TOKENS),
                )
    return table


def test_the_generated_models_window_is_shorter_than_every_prompt() -> None:
    """Otherwise the comparison below would not exercise the window at all."""
    assert all(SMALL_SHAPES[arch].sliding_window < min(map(len, PROMPTS)) for arch in ("gemma2", "gemma3"))


@pytest.mark.parametrize("case", CASES)
def test_logits_and_greedy_continuations_match_hf(
    gemma_models: dict[str, Path], expected: dict[tuple[str, int], tuple[torch.Tensor, list[int]]], case: Case
) -> None:
    with local_pipeline(gemma_models[case.architecture], case.spans, context=CONTEXT) as running:
        pools = [stage.service.engine.pool for stage in running]
        assert all(pool.window is not None for pool in pools if any(pool.windowed)), "sliding layers keep fewer cells"
        pipeline = Pipeline(f"127.0.0.1:{running[0].port}", fence=FENCE)
        pipeline.claim()
        requests = [Request(prompt=p, max_tokens=NEW_TOKENS, prompt_logits=True) for p in PROMPTS]
        completions = pipeline.generate(requests, slots=2, prefill_chunk=8)
    for index, completion in enumerate(completions):
        logits, continuation = expected[case.architecture, index]
        assert relative_error(torch.cat(completion.prompt_logits), logits) <= 1e-4
        assert completion.tokens == continuation
