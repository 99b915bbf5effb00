"""Paging changes where a position's K and V live, never what attention reads: with blocks of 3 cells (so two slots'
prompts and decodes cross many block boundaries and interleave their blocks) a pipeline computes bit for bit what it
computes with one 64-cell block per slot, on 1, 2 and 3 stages and in every cache type a stage stores.

The HF comparisons (test_model.py, test_pipeline_fidelity.py) hold the default layout to the reference; this holds
every other layout to the default.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from strata.gguf.model import CacheType
from strata.kv_layout import BLOCK_TOKENS
from strata.stage_worker.engine import Chunk, Engine
from strata.stage_worker.kv_pool import KVPool
from strata_testbed.stages import load_spans

CPU = torch.device("cpu")
PROMPTS = {
    0: (1, 17, 200, 3, 45, 99, 12, 7, 250, 31, 64, 128, 5, 77, 190, 2, 33, 81, 140, 9),
    1: (4, 8, 15, 16, 23, 42, 108, 99, 250, 1, 2, 3, 200),
}
CHUNK = 5
NEW_TOKENS = 12
SPANS = {1: [(0, 3)], 2: [(0, 2), (2, 3)], 3: [(0, 1), (1, 2), (2, 3)]}


def engines(path: Path, spans: list[tuple[int, int]], *, cache_type: CacheType, block: int) -> list[Engine]:
    built = []
    for (start, end), model in zip(spans, load_spans(path, spans), strict=True):
        c = model.config
        pool = KVPool(
            n_layers=end - start, context=64, parallel=2, key_width=c.kv_dim, value_width=c.kv_dim,
            type_k=cache_type, type_v=cache_type, dtype=torch.float32, device=CPU, block=block,
        )  # fmt: skip
        built.append(Engine(model=model, pool=pool, device=CPU, dtype=torch.float32))
    return built


def step(stages: list[Engine], chunks: list[Chunk]) -> tuple[dict[int, torch.Tensor], dict[int, tuple[int, float]]]:
    hidden = None
    for engine in stages:
        result = engine.step(chunks, hidden)
        hidden = result.hidden
    return result.logits, {slot: (picked.token_id, picked.logprob) for slot, picked in result.tokens.items()}


def generate(stages: list[Engine]) -> tuple[dict[int, list[torch.Tensor]], dict[int, list[tuple[int, float]]]]:
    """Both prompts prefilled together in chunks of CHUNK (their logits kept), the last chunk samples; then batched
    greedy decode steps of both slots. Returns the prefill logits and the picks (token, log-probability), per slot."""
    logits: dict[int, list[torch.Tensor]] = {slot: [] for slot in PROMPTS}
    tokens: dict[int, list[tuple[int, float]]] = {slot: [] for slot in PROMPTS}
    for start in range(0, max(len(p) for p in PROMPTS.values()), CHUNK):
        chunks = [
            Chunk(slot=slot, start_position=start, length=len(prompt[start : start + CHUNK]),
                  token_ids=prompt[start : start + CHUNK], return_logits=True,
                  sample=start + CHUNK >= len(prompt))
            for slot, prompt in PROMPTS.items()
            if start < len(prompt)
        ]  # fmt: skip
        out, picked = step(stages, chunks)
        for slot, rows in out.items():
            logits[slot].append(rows)
        for slot, token in picked.items():
            tokens[slot].append(token)
    for _ in range(NEW_TOKENS):
        chunks = [
            Chunk(slot=slot, start_position=len(prompt) + len(tokens[slot]) - 1, length=1,
                  token_ids=(tokens[slot][-1][0],), sample=True)
            for slot, prompt in PROMPTS.items()
        ]  # fmt: skip
        _, picked = step(stages, chunks)
        for slot, pick in picked.items():
            tokens[slot].append(pick)
    return logits, tokens


@pytest.mark.parametrize(
    "cache_type",
    [
        pytest.param(CacheType.F32, id="f32"),
        pytest.param(CacheType.F16, id="f16"),
        pytest.param(CacheType.BF16, id="bf16"),
        pytest.param(CacheType.Q8_0, id="q8_0"),
    ],
)
@pytest.mark.parametrize("stages", [pytest.param(n, id=f"{n} stage(s)") for n in SPANS])
def test_small_blocks_compute_bit_for_bit_what_one_block_per_slot_computes(
    tiny_models: dict[str, Path], cache_type: CacheType, stages: int
) -> None:
    path = tiny_models["llama"]
    paged_logits, paged_tokens = generate(engines(path, SPANS[stages], cache_type=cache_type, block=3))
    whole_logits, whole_tokens = generate(engines(path, SPANS[stages], cache_type=cache_type, block=BLOCK_TOKENS))
    assert paged_tokens == whole_tokens
    assert all(len(tokens) == NEW_TOKENS + 1 for tokens in paged_tokens.values())
    for slot in PROMPTS:
        for ours, theirs in zip(paged_logits[slot], whole_logits[slot], strict=True):
            assert torch.equal(ours, theirs)
