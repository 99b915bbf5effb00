"""The pool attention kernel against its plain reference, on the table of cases in strata_testbed.attention_cases.

Without a GPU the kernel runs under Triton's interpreter (the same kernel source, executed with numpy), in f32 and f16
(the interpreter has no bfloat16); bench/depth.py checks the same table on a GPU before it measures.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from strata.gguf.model import CacheType
from strata.stage_worker.kernels.paged_attention import (
    AttentionRule,
    attend_fresh,
    kernel,
    reference,
    round_q_int8,
)
from strata.stage_worker.kernels.paged_attention_triton import LaunchConfig
from strata.stage_worker.kv_pool import KVPool
from strata.stage_worker.model import step_layout
from strata_testbed.attention_cases import CASES, INT8_CASES, AttentionCase, relative_error, run_case, tolerance

TRITON_MODULE = "strata.stage_worker.kernels.paged_attention_triton"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("case", [c for c in CASES if not c.gpu_only], ids=lambda c: c.name)
def test_kernel_matches_reference(case: AttentionCase, dtype: torch.dtype, device: torch.device) -> None:
    error = run_case(case, device=device, dtype=dtype, seed=hash(case.name) % 1000)
    assert error <= tolerance(dtype), f"{case.name}: relative error {error:.2e} over {tolerance(dtype):.0e}"


def test_a_wrong_kernel_fails_the_check(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: a kernel that drops the last position of every sequence is caught."""
    module = importlib.import_module(TRITON_MODULE)
    real = module.paged_attention

    def short(q: torch.Tensor, **kwargs: object) -> torch.Tensor:
        kv_lens = kwargs.pop("kv_lens")
        assert isinstance(kv_lens, torch.Tensor)
        out: torch.Tensor = real(q, kv_lens=(kv_lens - 1).clamp_min(1), **kwargs)
        return out

    monkeypatch.setattr(module, "paged_attention", short)
    case = AttentionCase("short by one", kv_lens=(5, 40))
    assert run_case(case, device=device, dtype=torch.float32) > 1e-2


# (slot, start position, length) of each chunk of one step, in row order: decode rows and a prefill from position 0
# between them, as continuous batching mixes them.
MIXED_STEP = ((0, 20, 1), (1, 0, 5), (2, 9, 3), (3, 30, 1), (4, 20, 1))


def test_a_mixed_step_reads_its_sequences_as_the_reference_does(device: torch.device) -> None:
    """The sequences a step's layout builds (chunks that continue a slot, a prefill from position 0 among them, decode
    rows) give the kernel what they give the reference: every row matches, not only the first sequence's."""
    width, n_head, n_head_kv, head_dim = 64, 4, 2, 32
    pool = KVPool(
        n_layers=1, context=128, parallel=len(MIXED_STEP), key_width=width, value_width=width,
        type_k=CacheType.Q8_0, type_v=CacheType.Q8_0, dtype=torch.float32, device=device,
    )  # fmt: skip
    g = torch.Generator().manual_seed(7)
    writes, held = [], []
    for slot, start, length in MIXED_STEP:
        if start:  # the slot's earlier positions, as a previous step left them
            pool.extend(slot=slot, start_position=0, length=start)
        extension = pool.extend(slot=slot, start_position=start, length=length)
        writes.append(extension.full.new)
        held.append(extension.full.cells)
    cells = torch.cat(held)
    pool.layers[0].write(cells, torch.randn(cells.shape[0], width, generator=g).to(device),
                         torch.randn(cells.shape[0], width, generator=g).to(device))  # fmt: skip
    rows = sum(length for _, _, length in MIXED_STEP)
    layout = step_layout(
        positions=torch.zeros(rows, dtype=torch.long), write_cells=torch.cat(writes), chunks=MIXED_STEP,
        table=pool.table,
    )  # fmt: skip
    assert layout.sequences.q_lens.tolist() == [length for _, _, length in MIXED_STEP]
    q = torch.randn(rows, n_head, head_dim, generator=g).to(device)
    args = {"table": pool.table, "sequences": layout.sequences, "n_head_kv": n_head_kv}
    rule = AttentionRule(scale=head_dim**-0.5)
    ours = kernel(q, pool.layers[0], rule=rule, **args)  # type: ignore[arg-type]
    expected = reference(q, pool.layers[0], rule=rule, **args)  # type: ignore[arg-type]
    error = relative_error(ours, expected)
    assert error <= tolerance(torch.float32), f"relative error {error:.2e}"


def test_strided_sequences_are_refused(device: torch.device) -> None:
    """A transposed view as a sequence field is refused by name, never read as if it were dense."""
    columns = torch.tensor([(0, 0, 1, 3), (1, 1, 1, 3)], dtype=torch.long, device=device).T  # [4, S] strided rows
    slots, q_starts, q_lens, kv_lens = columns
    module = importlib.import_module(TRITON_MODULE)
    pool = KVPool(
        n_layers=1, context=8, parallel=2, key_width=64, value_width=64, type_k=CacheType.F32, type_v=CacheType.F32,
        dtype=torch.float32, device=device,
    )  # fmt: skip
    cache = pool.layers[0]
    with pytest.raises(ValueError, match="slots must be one contiguous tensor"):
        module.paged_attention(
            torch.zeros(2, 4, 32, device=device), keys=cache.keys.values, key_scales=None, values=cache.values.values,
            value_scales=None, table=pool.table, slots=slots, q_starts=q_starts, q_lens=q_lens, kv_lens=kv_lens,
            max_q_len=1, n_head_kv=2, scale=1.0,
        )  # fmt: skip


@pytest.mark.parametrize("rule", [AttentionRule(scale=0.125, window=64), AttentionRule(scale=0.125, softcap=30.0)],
                         ids=["window", "soft-cap"])  # fmt: skip
def test_the_flash_path_refuses_a_window_or_a_cap(rule: AttentionRule, device: torch.device) -> None:
    pool = KVPool(
        n_layers=1, context=8, parallel=1, key_width=64, value_width=64, type_k=CacheType.F32, type_v=CacheType.F32,
        dtype=torch.float32, device=device,
    )  # fmt: skip
    with pytest.raises(ValueError, match="reads the pool"):
        attend_fresh(torch.zeros(4, 2, 32), pool.layers[0], cells=torch.arange(4), n_head_kv=2, rule=rule)


# The interpreter's share of the integer-score cases: the GPU's fidelity check (bench/depth.py) runs them all.
INTERPRETED_INT8_CASES = [c for c in INT8_CASES if not c.gpu_only and max(c.kv_lens) < 1000]
INT8_SCORES = LaunchConfig(int8_scores=True)


@pytest.mark.parametrize("case", INTERPRETED_INT8_CASES, ids=lambda c: c.name)
def test_integer_scores_are_the_reference_on_q_rounded_to_int8(case: AttentionCase, device: torch.device) -> None:
    """The kernel's integer scores compute attention of q rounded to int8 a block of 32 (round_q_int8) to the 16-bit
    path's accuracy; against the exact q, the rounding stays inside the bound the bf16 path is held to. In these cases
    it is about 3.4x bf16's own rounding of q (300 positions: 6.6e-3 against 1.9e-3), as llama.cpp's q8_1 Q is."""
    rounded = run_case(
        case,
        device=device,
        dtype=torch.float16,
        seed=3,
        launch=INT8_SCORES,
        reference_q=round_q_int8,
    )
    exact = run_case(case, device=device, dtype=torch.float16, seed=3, launch=INT8_SCORES)
    assert rounded <= tolerance(torch.float16), f"{case.name}: {rounded:.2e} from attention of the rounded q"
    assert exact <= tolerance(torch.bfloat16), f"{case.name}: {exact:.2e} from attention of the exact q"


def test_integer_scores_are_the_path_taken(device: torch.device) -> None:
    """The check above is of the integer products: over many positions q's rounding moves the output off the 16-bit
    path's (one position would not show it: its softmax is 1 whatever the score)."""
    case = AttentionCase("300 positions, heads of 128", kv_lens=(300,), head_dim=128)
    integer = run_case(case, device=device, dtype=torch.float16, seed=3, launch=INT8_SCORES)
    sixteen_bit = run_case(case, device=device, dtype=torch.float16, seed=3, launch=LaunchConfig())
    assert integer != sixteen_bit


# Launch variants against the reference, each on the cases that exercise it: how much of a head one merge program
# takes (LaunchConfig.merge_values: heads narrower and wider than it, not a multiple of it), and each tile loading its
# own cells rather than the next tile's (LaunchConfig.cells_ahead, the default: tiles of a split, a window and chunks
# after cached positions). The q8_0 bytes converted four a register (LaunchConfig.packed_int8) are PTX, which the
# interpreter does not run: bench/depth.py's GPU checks take every case under them.
LAUNCH_VARIANTS = {
    "a merge of 16 values a program": (
        LaunchConfig(merge_values=16),
        ("one stream, 300 positions", "head dim 48 (heads not on q8_0 block edges)", "head dim 256"),
    ),
    "a merge of a whole head a program": (
        LaunchConfig(merge_values=1 << 20),
        ("one stream, 300 positions", "head dim 48 (heads not on q8_0 block edges)", "head dim 256"),
    ),
    "cells loaded in their own tile": (
        LaunchConfig(cells_ahead=False),
        (
            "one stream, 300 positions",
            "lengths around a tile edge",
            "a window of 100 over decode rows",
            "a window of 32 over chunks after cached positions",
        ),
    ),
}


@pytest.mark.parametrize(
    ("launch", "case"),
    [
        pytest.param(launch, case, id=f"{variant}: {case.name}")
        for variant, (launch, names) in LAUNCH_VARIANTS.items()
        for case in CASES
        if case.name in names
    ],
)
def test_launch_variants_match_the_reference(launch: LaunchConfig, case: AttentionCase, device: torch.device) -> None:
    error = run_case(case, device=device, dtype=torch.float16, seed=5, launch=launch)
    assert error <= tolerance(torch.float16), f"{case.name}: relative error {error:.2e}"
