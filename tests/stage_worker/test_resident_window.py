"""The resident window (strata.stage_worker.kv_resident): the bound it scores blocks by holds, the choice finds a
planted needle, the compacted row names the cells of the positions it says, and a window that keeps every block
decodes exactly as the full pool does, through prefill, rollback, drafts and a reset."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from strata.gguf.model import CacheType
from strata.gguf.testmodels.writer import write_test_model
from strata.kv_layout import ResidentBudget
from strata.stage_worker.engine import Chunk, Engine
from strata.stage_worker.kv_pool import KVPool
from strata.stage_worker.kv_resident import ResidentShape, block_shares, choose, score_bounds
from strata_testbed.small_pools import BLOCK, LAYERS, prefill, small_pool
from strata_testbed.stages import cpu_engines, through

HEAD_DIM = 32  # small_pool's rows of 64 values: two KV heads


def test_the_bound_is_at_least_every_score_of_its_block() -> None:
    generator = torch.Generator().manual_seed(1)
    layers, heads, kv_heads, blocks, size = 3, 4, 2, 5, 8
    keys = torch.randn(layers, blocks, size, kv_heads, HEAD_DIM, generator=generator) * 3
    queries = torch.randn(layers, heads, HEAD_DIM, generator=generator)
    bounds = torch.stack([keys.amin(dim=2), keys.amax(dim=2)], dim=2)  # [L, C, 2, Hkv, hd]
    bound = score_bounds(queries, bounds)  # [L, Hkv, G, C]
    q = queries.view(layers, kv_heads, heads // kv_heads, HEAD_DIM)
    scores = torch.einsum("lkgd,lcskd->lkgcs", q, keys).amax(dim=-1)  # the best key of each block, per head
    assert bool((bound >= scores - 1e-4).all())


@dataclass(frozen=True)
class NeedleCase:
    candidates: int
    needles: tuple[int, ...]  # candidate indices whose keys line up with the query
    keep: int
    layers_with_needle: tuple[int, ...]  # of 3 layers
    heads: int = 4  # query heads over 2 KV heads


NEEDLE_CASES = [
    pytest.param(NeedleCase(12, (7,), 3, (0, 1, 2)), id="one needle, every layer"),
    pytest.param(NeedleCase(12, (0,), 3, (0, 1, 2)), id="the first candidate"),
    pytest.param(NeedleCase(12, (11,), 1, (1,)), id="seen by one layer of three"),
    pytest.param(NeedleCase(20, (3, 15), 2, (0, 2)), id="two needles, keep two"),
    pytest.param(NeedleCase(6, (2,), 2, (0, 1, 2), heads=2), id="one query head a KV head"),
]


@pytest.mark.parametrize("case", NEEDLE_CASES)
def test_the_choice_keeps_the_blocks_whose_keys_answer_the_query(case: NeedleCase) -> None:
    generator = torch.Generator().manual_seed(2)
    layers, kv_heads, size = 3, 2, 8
    queries = torch.randn(layers, case.heads, HEAD_DIM, generator=generator)
    keys = torch.randn(layers, case.candidates, size, kv_heads, HEAD_DIM, generator=generator) * 0.3
    for layer in case.layers_with_needle:
        for needle in case.needles:
            group = case.heads // kv_heads
            keys[layer, needle, 3] = 4 * queries[layer].view(kv_heads, group, HEAD_DIM).mean(dim=1)
    bounds = torch.stack([keys.amin(dim=2), keys.amax(dim=2)], dim=2)
    shares = block_shares(queries, bounds, scales=torch.full((layers,), HEAD_DIM**-0.5))
    candidates = list(range(100, 100 + case.candidates))
    chosen = choose(shares, candidates=torch.tensor(candidates), keep=case.keep).tolist()
    assert set(chosen) >= {candidates[n] for n in case.needles}
    assert chosen == sorted(chosen)
    assert len(chosen) == case.keep


def _pool_with_window(shape: ResidentShape) -> KVPool:
    pool = small_pool(CacheType.F32, context=256, parallel=2)
    pool.keep_resident(shape, n_head=4, head_dim=HEAD_DIM, scales=[HEAD_DIM**-0.5] * LAYERS)
    assert pool.resident is not None
    assert len(pool.resident.layers) == LAYERS
    return pool


def test_a_chosen_row_names_the_cells_of_the_sinks_the_chosen_blocks_and_the_recent_positions() -> None:
    shape = ResidentShape(sinks=1, selected=2, recent=2 * BLOCK, block=BLOCK)
    pool = _pool_with_window(shape)
    prefill(pool, slot=1, length=24, seed=0)  # the other slot's blocks interleave with slot 0's
    length, needle = 160, 9  # block 9 holds positions 72..79
    prefill(pool, slot=0, length=length, seed=1)
    resident = pool.resident
    assert resident is not None
    query = torch.randn(4, HEAD_DIM, generator=torch.Generator().manual_seed(3))
    ((first,),) = [[t.column for t in run] for run in pool.take_runs([(0, length, 1)])]
    assert first == length, "before a decode step recorded a query the slot sees every position"
    needle_cells = pool.table[0, needle * BLOCK : (needle + 1) * BLOCK]
    for layer in pool.layers:
        assert layer.queries is not None
        layer.queries[0] = query  # what the decode step at `length` records
        layer.keys.values[needle_cells] = 5 * query.view(2, 2, HEAD_DIM).mean(dim=1).flatten()
    taken = pool.take(slot=0, position=length + 1)
    seen = resident.seen(0, length + 1)
    tail = (length + 1 - shape.recent) // BLOCK * BLOCK
    assert seen[:BLOCK] == list(range(BLOCK)), "the sink block comes first"
    assert list(range(needle * BLOCK, (needle + 1) * BLOCK)) == [p for p in seen if needle * BLOCK <= p < tail][:BLOCK]
    assert seen[(1 + shape.selected) * BLOCK :] == list(range(tail, length + 1))
    assert taken.column == len(seen), "the new position's column follows what it sees"
    index = torch.tensor(seen)
    assert torch.equal(resident.table[0, : len(seen)], pool.table[0, index])
    assert resident.choices == 1


def _generate(engine: Engine, prompt: list[int], steps: int, *, slot: int = 0, rollback: int = 0) -> list[int]:
    """A prompt then greedy steps; with `rollback`, every 7th step goes back that many positions and replays them
    as a drafted chunk (a speculative step the target accepts), which takes the step's several rows a slot."""
    result = through([engine], [Chunk(slot, 0, len(prompt), tuple(prompt), sample=True)])
    tokens = [*prompt, result.tokens[slot].token_id]
    while len(tokens) < len(prompt) + 1 + steps:
        position = len(tokens) - 1
        if rollback and position % 7 == 0 and position - rollback > len(prompt):
            start = position - rollback
            run = tuple(tokens[start : position + 1])
            chunk = Chunk(slot, start, len(run), run, sample=True, drafted=len(run) - 1)
            picked = [sampled.token_id for sampled in through([engine], [chunk]).runs[slot]]
            assert picked[:-1] == list(run[1:]), "the step accepts the tokens it picked before"
            tokens.append(picked[-1])
            continue
        result = through([engine], [Chunk(slot, position, 1, (tokens[-1],), sample=True)])
        tokens.append(result.tokens[slot].token_id)
    return tokens[len(prompt) :]


@dataclass(frozen=True)
class ExactCase:
    architecture: str
    prompt: int
    steps: int
    rollback: int = 0
    window_space: bool = False
    cache_type: CacheType = CacheType.F32


EXACT_CASES = [
    pytest.param(ExactCase("llama", 60, 40), id="llama"),
    pytest.param(ExactCase("llama", 60, 40, rollback=3), id="llama, rolled back and drafted"),
    pytest.param(ExactCase("llama", 60, 30, cache_type=CacheType.Q8_0), id="llama, q8_0 cache"),
    pytest.param(ExactCase("gemma3", 50, 30), id="gemma3, windows masked in the full table"),
    pytest.param(ExactCase("gemma3", 50, 30, window_space=True), id="gemma3, windows in a space of their own"),
]


@pytest.mark.parametrize("case", EXACT_CASES)
def test_a_window_that_keeps_every_block_decodes_as_the_full_pool(case: ExactCase, tmp_path: Path) -> None:
    """Sinks, chosen blocks and recent positions that cover everything: the rows are compacted and chosen again every
    block, and the step must pick what the full pool picks."""
    model = write_test_model(tmp_path / "m.gguf", architecture=case.architecture)
    prompt = [1 + (37 * i) % 250 for i in range(case.prompt)]
    every = ResidentShape(sinks=1, selected=64, recent=2 * BLOCK, block=BLOCK)
    tokens = {}
    for name, shape in (("full", None), ("resident", every)):
        (engine,) = cpu_engines(
            model.path, [(0, model.shape.block_count)], cache_type=case.cache_type, context=256, block=BLOCK,
            resident=shape, window_space=case.window_space,
        )  # fmt: skip
        tokens[name] = _generate(engine, prompt, case.steps, rollback=case.rollback)
        if engine.pool.resident is not None:
            assert engine.pool.resident.choices == 0, "every block fits: nothing is scored"
    assert tokens["resident"] == tokens["full"]


def test_a_small_window_sees_at_most_its_tokens_and_a_reset_forgets_its_choice(tmp_path: Path) -> None:
    model = write_test_model(tmp_path / "m.gguf", architecture="llama")
    shape = ResidentShape(sinks=1, selected=3, recent=2 * BLOCK, block=BLOCK)
    (engine,) = cpu_engines(model.path, [(0, model.shape.block_count)], cache_type=CacheType.F32, context=256,
                            block=BLOCK, resident=shape)  # fmt: skip
    resident = engine.pool.resident
    assert resident is not None
    prompt = [1 + (37 * i) % 250 for i in range(90)]
    _generate(engine, prompt, 30)
    end = engine.pool.length(0)
    seen = resident.seen(0, end)
    assert resident.choices > 0
    assert len(seen) <= shape.tokens < end
    assert seen == sorted(seen)
    assert seen[:BLOCK] == list(range(BLOCK))
    assert seen[-shape.recent :] == list(range(end - shape.recent, end))
    engine.pool.reset(0)
    (fresh,) = cpu_engines(model.path, [(0, model.shape.block_count)], cache_type=CacheType.F32, context=256,
                           block=BLOCK)  # fmt: skip
    short = prompt[:20]
    assert _generate(engine, short, 8) == _generate(fresh, short, 8), "a new sequence within the window is exact"


@pytest.mark.parametrize(
    ("tokens", "sinks", "recent", "message"),
    [
        pytest.param(4096, 64, 1024, None, id="the default split"),
        pytest.param(1024, 64, 1024, "leaves no block to choose", id="sinks and recent take it all"),
        pytest.param(100, 0, 64, "leaves no block to choose", id="less than a block left"),
        pytest.param(4096, -1, 64, "must not be negative", id="negative sinks"),
    ],
)
def test_a_window_shape_from_tokens(tokens: int, sinks: int, recent: int, message: str | None) -> None:
    if message is None:
        shape = ResidentShape.of(ResidentBudget(tokens, sinks, recent), block=64)
        assert (shape.sinks, shape.selected, shape.recent) == (1, 46, 1024)
        assert shape.tokens == tokens, "a step never sees more than the window"
        return
    with pytest.raises(ValueError, match=message):
        ResidentShape.of(ResidentBudget(tokens, sinks, recent), block=64)


def test_recent_positions_must_cover_a_window_read_through_the_same_table() -> None:
    pool = small_pool(CacheType.F32, context=32, parallel=1, window=24)  # the window space would not be smaller
    assert pool.window is None
    with pytest.raises(ValueError, match="must cover the sliding window of 24"):
        pool.keep_resident(
            ResidentShape(sinks=1, selected=2, recent=2 * BLOCK, block=BLOCK), n_head=4, head_dim=HEAD_DIM,
            scales=[None, 1.0],
        )  # fmt: skip


@pytest.mark.parametrize("window_space", [False, True], ids=["windows masked in the full table", "a window space"])
def test_the_window_chooses_by_the_full_attention_layers_alone(window_space: bool, tmp_path: Path) -> None:
    model = write_test_model(tmp_path / "m.gguf", architecture="gemma3")
    shape = ResidentShape(sinks=1, selected=2, recent=2 * BLOCK, block=BLOCK)
    (engine,) = cpu_engines(model.path, [(0, model.shape.block_count)], cache_type=CacheType.F32, context=256,
                            block=BLOCK, resident=shape, window_space=window_space)  # fmt: skip
    resident = engine.pool.resident
    assert resident is not None
    config = engine.model.config
    full = [engine.pool.layers[il] for il in range(config.n_layer) if not config.is_sliding(il)]
    assert resident.layers == full
    assert resident.scales.tolist() == [config.attention_rule(il).scale for il in range(config.n_layer)
                                        if not config.is_sliding(il)]  # fmt: skip
    assert all(layer.queries is None for layer in engine.pool.layers if layer not in full)
