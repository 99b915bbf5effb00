"""The decode steps a stage warms up (strata.stage_worker.warm_steps): one and two slots, then the first shape of each
kernel variant its steps can meet, and the products' kernel variants by rows (strata.stage_worker.kernels)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

import pytest
import torch
from strata.gguf.model import CacheType
from strata.gguf.testmodels import write_test_model
from strata.stage_worker.decode import WIDEST, Decoder
from strata.stage_worker.engine import Chunk, Engine
from strata.stage_worker.kernels.quant_matmul import FUSED_MAX_ROWS, GEMM_MAX_ROWS, rows_variant
from strata.stage_worker.kv_pool import KVPool
from strata.stage_worker.warm_steps import prefill_probes, prefill_shapes, warm_prefill, warm_shapes
from strata_testbed.stages import load_spans

ONE_ROW = (1,)
EVERY_WIDTH = tuple(range(1, WIDEST + 1))
SHAPES: list[tuple[str, int, Callable[[int, int], Hashable], Sequence[int], list[tuple[int, int]]]] = [
    ("nothing compiled: one slot and two", 16, lambda s, w: None, ONE_ROW, [(1, 1), (2, 1)]),
    ("one lane: one slot", 1, lambda s, w: None, ONE_ROW, [(1, 1)]),
    ("a variant for steps of several rows", 4, lambda s, w: w > 1, ONE_ROW, [(1, 1), (2, 1), (1, 2)]),
    ("a variant past 8 slots", 16, lambda s, w: s > 8, ONE_ROW, [(1, 1), (2, 1), (9, 1)]),
    (
        "blocks compiled at every width: one slot and two at each",
        16,
        lambda s, w: None,
        EVERY_WIDTH,
        [(s, w) for w in EVERY_WIDTH for s in (1, 2)],
    ),
    ("every width, one lane: one slot at each", 1, lambda s, w: None, EVERY_WIDTH, [(1, w) for w in EVERY_WIDTH]),
    (
        "every width and a variant past 8 slots",
        16,
        lambda s, w: s > 8,
        EVERY_WIDTH,
        [*((s, w) for w in EVERY_WIDTH for s in (1, 2)), (9, 1)],
    ),
    (
        "variants by rows: the first shape of each",
        16,
        lambda s, w: rows_variant(s * w),
        ONE_ROW,
        [
            (1, 1),
            (2, 1),
            (3, 1),
            *((s, 1) for s in range(5, 17)),
            *((s, 2) for s in range(9, 17)),
            (7, 3),
            *((s, 3) for s in range(9, 17) if s != 10),
            (10, 4),
            (11, 4),
            (13, 4),
            (14, 4),
            (15, 4),
            (16, 4),
            (5, 5),
            (7, 5),
            (10, 5),
            (11, 5),
            (13, 5),
            (9, 6),
            (7, 7),
            (9, 7),
        ],
    ),
]


@pytest.mark.parametrize(
    ("parallel", "variant", "widths", "expected"), [c[1:] for c in SHAPES], ids=[c[0] for c in SHAPES]
)
def test_warm_shapes(
    parallel: int, variant: Callable[[int, int], Hashable], widths: Sequence[int], expected: list[tuple[int, int]]
) -> None:
    shapes = warm_shapes(parallel, variant, widths)
    assert shapes == expected
    met = {variant(s, w) for s in range(1, parallel + 1) for w in range(1, WIDEST + 1)}
    assert {variant(s, w) for s, w in shapes} == met, "a variant a step can meet is left to compile while serving"


ROWS = [
    ("one row: the fused kernel, alone", 1, ("fused", 1, True)),
    ("three rows: the fused kernel's tile of 4", 3, ("fused", 4, False)),
    ("the fused kernel's last", FUSED_MAX_ROWS, ("fused", FUSED_MAX_ROWS, False)),
    ("past it: the tensor-core kernel, by its rows", FUSED_MAX_ROWS + 1, ("gemm", FUSED_MAX_ROWS + 1, False)),
    ("the tensor-core kernel's last", GEMM_MAX_ROWS, ("gemm", GEMM_MAX_ROWS, False)),
    ("past it: dequantise, then cuBLAS", GEMM_MAX_ROWS + 1, ("dense", 0, False)),
]


@pytest.mark.parametrize(("rows", "expected"), [c[1:] for c in ROWS], ids=[c[0] for c in ROWS])
def test_rows_variant(rows: int, expected: tuple[str, int, bool]) -> None:
    assert rows_variant(rows) == expected


def _programs(limit: int) -> Callable[[int, int], Hashable]:
    """A launch whose variant follows its programs (sequences by 16-row query tiles) up to `limit`, as the attention
    kernel's splits and warps do."""
    return lambda sequences, rows: min(limit, sequences * -(-rows // 16))


PREFILLS: list[tuple[str, int, int, Callable[[int, int], Hashable], set[Hashable], list[tuple[int, int]]]] = [
    ("nothing compiled: no step", 16, 256, lambda s, r: None, {None}, []),
    ("a variant past 8 sequences: 9 prompts, each of two rows", 16, 256, lambda s, r: s > 8, {False}, [(9, 2)]),
    ("a variant past 32 rows: one prompt of 33", 16, 256, lambda s, r: r > 32, {False}, [(1, 33)]),
    ("a variant the decode steps met: no step", 16, 256, lambda s, r: r > 32, {False, True}, []),
    (
        "by programs: the step of fewest cells for each, fewest first",
        4,
        256,
        _programs(6),
        {1},
        [(2, 2), (3, 2), (4, 2), (3, 17), (1, 65)],
    ),
    ("a pool too short for the variant's rows: none", 1, 16, lambda s, r: r > 32, {False}, []),
]


@pytest.mark.parametrize(
    ("parallel", "longest", "variant", "met", "expected"), [c[1:] for c in PREFILLS], ids=[c[0] for c in PREFILLS]
)
def test_prefill_shapes(
    parallel: int,
    longest: int,
    variant: Callable[[int, int], Hashable],
    met: set[Hashable],
    expected: list[tuple[int, int]],
) -> None:
    shapes = prefill_shapes(parallel, variant, tile=16, most_tiles=lambda sequences: -(-longest // 16), met=met)
    assert shapes == expected
    reachable = {variant(s, r) for s in range(1, parallel + 1) for r in range(2, longest + 1)}
    assert {variant(s, r) for s, r in shapes} | met >= reachable, "a prefill variant is left to compile while serving"


@pytest.mark.parametrize("n_head_kv", [1, 8], ids=["one KV head", "eight KV heads"])
def test_prefill_shapes_of_the_attention_kernel_cover_it_past_saturation(n_head_kv: int) -> None:
    """The warm-up's bound on a sequence's tiles (where the launch saturates) leaves no variant of the real launch
    rule out: every one that steps of up to 4 sequences and twice that many rows meet is among those it runs."""
    from strata.stage_worker.kernels.paged_attention_triton import saturating_programs, tile_shape

    device = torch.device("cpu")  # the launch rule reads the multiprocessors of a CUDA device; 8 elsewhere

    def variant(sequences: int, rows: int) -> Hashable:
        return tile_shape(
            n_seq=sequences, max_q_len=rows, n_head=4 * n_head_kv, n_head_kv=n_head_kv, head_dim=64, device=device
        ).variant

    saturated = saturating_programs(device)
    longest = 2 * 32 * saturated  # past where a long chunk's tiles (32 positions of 4 heads) saturate the launch
    tile, most_tiles = prefill_probes(
        n_head=4 * n_head_kv, n_head_kv=n_head_kv, head_dim=64, context=longest, device=device
    )
    shapes = prefill_shapes(4, variant, tile=tile, most_tiles=most_tiles)
    reachable = {variant(s, r) for s in range(1, 5) for r in range(2, longest + 1, 7)}
    assert {variant(s, r) for s, r in shapes} >= reachable
    assert len(shapes) > 2, "the launch rule has several prefill variants: the check above would prove little"


def _engine(path: Path) -> Engine:
    (model,) = load_spans(path, dtype=torch.float32, device=torch.device("cpu"))
    c = model.config
    pool = KVPool(
        n_layers=c.n_layer, context=64, parallel=3, key_width=c.kv_dim, value_width=c.kv_dim,
        type_k=CacheType.F32, type_v=CacheType.F32, dtype=torch.float32, device=torch.device("cpu"),
    )  # fmt: skip
    return Engine(model=model, pool=pool, device=torch.device("cpu"), dtype=torch.float32)


def test_warm_up_runs_its_steps_and_leaves_the_pool_empty(tmp_path: Path) -> None:
    engine = _engine(write_test_model(tmp_path / "model.gguf", architecture="llama", block_count=2).path)
    free = engine.pool.free_cells
    engine.warm_up()
    assert engine.pool.free_cells == free


def test_warm_up_runs_under_inference_mode_as_steps_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled code is kept by the grad mode it was made in: warmed up with grad enabled, every step shape first met
    while serving (under inference mode) compiled its blocks again (an H200, 2026-11-28)."""
    engine = _engine(write_test_model(tmp_path / "model.gguf", architecture="llama", block_count=2).path)
    modes: list[bool] = []
    run = Decoder.run

    def recorded(self: Decoder, **kwargs: object) -> object:
        modes.append(torch.is_inference_mode_enabled())
        return run(self, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Decoder, "run", recorded)
    engine.warm_up()
    engine.step([Chunk(slot=0, start_position=0, length=2, token_ids=(5, 6), sample=True)], None)
    engine.step([Chunk(slot=0, start_position=2, length=1, token_ids=(7,), sample=True)], None)
    assert len(modes) >= 3, "the warm-up and the decode step ran the decoder"
    assert all(modes), modes


def test_the_prefill_warm_up_runs_each_shape_it_plans_and_leaves_the_pool_empty(tmp_path: Path) -> None:
    """The executor of prefill_shapes, on the CPU with the attention kernel's launch rule as the variant (on a GPU the
    default): a prefill step of each shape that fits the pool runs through the engine, and its cells come back."""
    from strata.stage_worker.kernels.paged_attention_triton import tile_shape

    engine = _engine(write_test_model(tmp_path / "model.gguf", architecture="llama", block_count=2).path)
    c, cpu = engine.model.config, torch.device("cpu")

    def variant(sequences: int, rows: int) -> Hashable:
        return tile_shape(
            n_seq=sequences, max_q_len=rows, n_head=c.n_head, n_head_kv=c.n_head_kv, head_dim=c.head_dim, device=cpu
        ).variant

    steps: list[list[tuple[int, int, int]]] = []

    def forward(pieces: list[tuple[int, int, int]], hidden: torch.Tensor) -> torch.Tensor:
        steps.append(pieces)
        return engine._forward_in_parts(pieces, hidden)

    free = engine.pool.free_cells
    ran = warm_prefill(
        forward=forward, pool=engine.pool, model=engine.model, device=cpu, dtype=torch.float32, met=[], variant=variant
    )
    assert ran, "the launch rule has prefill variants a 3-slot pool meets"
    assert [(len(p), p[0][2]) for p in steps] == ran, "each shape ran as one step of its sequences"
    assert all(rest == (slot, 0, 1) for p in steps for slot, rest in enumerate(p) if slot), steps
    assert engine.pool.free_cells == free
    assert (
        warm_prefill(forward=forward, pool=engine.pool, model=engine.model, device=cpu, dtype=torch.float32, met=[])
        == []
    )
