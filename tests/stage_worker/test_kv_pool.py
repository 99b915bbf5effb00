"""The KV pool allocates what the planner budgeted, stores q8_0 as ggml does, and shares cells between slots."""

from __future__ import annotations

import pytest
import torch
from strata.gguf.model import CacheType, ModelInfo
from strata.kv_layout import BLOCK_TOKENS
from strata.stage_worker.errors import ContextExceededError, PoolExhaustedError, UnknownSlotError
from strata.stage_worker.kv_pool import KVPool
from strata.stage_worker.kv_stores import Store

CPU = torch.device("cpu")


def llama3_8b_like(n_layer: int = 32) -> ModelInfo:
    return ModelInfo(
        architecture="llama",
        block_count=n_layer,
        embedding_length=4096,
        head_count=32,
        head_count_kv=(8,) * n_layer,
        key_length=128,
        value_length=128,
        context_length=8192,
        vocab_size=128256,
        layer_bytes=(0,) * n_layer,
        non_layer_bytes={},
        layer_resident_bytes=(0,) * n_layer,
        non_layer_resident_bytes={},
        output_tied=False,
    )


def pool(
    *, layers: int, context: int, type_k: CacheType, type_v: CacheType, parallel: int = 4, block: int = 2
) -> KVPool:
    return KVPool(
        n_layers=layers,
        context=context,
        parallel=parallel,
        key_width=8 * 128,
        value_width=8 * 128,
        type_k=type_k,
        type_v=type_v,
        dtype=torch.float32,
        device=CPU,
        block=block,
    )


@pytest.mark.parametrize(
    ("type_k", "type_v", "span"),
    [
        pytest.param(CacheType.F16, CacheType.F16, range(0, 32), id="f16 for the whole model matches the plan"),
        pytest.param(CacheType.Q8_0, CacheType.Q8_0, range(10, 21), id="q8_0 for a middle span matches the plan"),
        pytest.param(CacheType.Q8_0, CacheType.F16, range(0, 5), id="mixed k and v types match the plan"),
        pytest.param(CacheType.F32, CacheType.F32, range(31, 32), id="f32 for the last layer matches the plan"),
    ],
)
def test_pool_bytes_match_the_planned_kv_bytes(type_k: CacheType, type_v: CacheType, span: range) -> None:
    info = llama3_8b_like()
    planned = info.kv_bytes(n_ctx=512, type_k=type_k, type_v=type_v, layers=span, n_seq=4)
    allocated = pool(layers=len(span), context=512, type_k=type_k, type_v=type_v, block=BLOCK_TOKENS).nbytes
    assert abs(allocated - planned) <= 0.02 * planned


def test_q8_0_store_keeps_values_within_a_rounding_step_of_their_block_scale() -> None:
    store = Store(cache_type=CacheType.Q8_0, cells=4, width=64, device=CPU)
    rows = torch.randn(2, 64) * torch.tensor([0.01, 30.0])[:, None]
    store.write(torch.tensor([3, 1]), rows)
    back = store.read(torch.tensor([3, 1]), dtype=torch.float32)
    step = rows.view(2, 2, 32).abs().amax(-1) / 127  # [rows, blocks]
    error = (back - rows).abs().view(2, 2, 32)
    # Half a step from rounding to int8, plus the f16 scale's rounding (2**-11 relative) times at most 127.
    assert torch.all(error <= step[..., None] * (0.5 + 127 * 2**-11) + 1e-7)


def test_slots_share_one_pool_in_blocks_and_reset_returns_them() -> None:
    kv = pool(layers=1, context=8, type_k=CacheType.F16, type_v=CacheType.F16, parallel=2)
    assert kv.full.cells == 8 + 2, "the context's four blocks of two, and a partial last block for the second slot"
    kv.extend(slot=0, start_position=0, length=5)  # three blocks, the last half used
    kv.extend(slot=1, start_position=0, length=3)  # lengths that sum to the context fit
    kv.extend(slot=1, start_position=3, length=1)  # inside slot 1's last block
    with pytest.raises(PoolExhaustedError, match=r"slot 1 needs 1 KV blocks \(2 cells\) but only 0 of 5 blocks"):
        kv.extend(slot=1, start_position=4, length=1)
    kv.reset(0)
    kv.extend(slot=1, start_position=4, length=4)
    assert kv.free_cells == 2


def test_a_chunk_that_rewinds_a_slot_reuses_its_cells() -> None:
    kv = pool(layers=1, context=8, type_k=CacheType.F16, type_v=CacheType.F16, parallel=1)
    first = kv.extend(slot=0, start_position=0, length=5).full.cells.clone()
    again = kv.extend(slot=0, start_position=3, length=2).full
    assert again.cells[:3].tolist() == first[:3].tolist()
    assert (kv.length(0), kv.free_cells, again.new.shape) == (5, 2, (2,)), "a slot holds whole blocks"


@pytest.mark.parametrize(
    ("slot", "start", "length", "error", "message"),
    [
        pytest.param(2, 0, 1, UnknownSlotError, "slot 2 does not exist", id="an unknown slot is refused"),
        pytest.param(0, 3, 1, ContextExceededError, "cannot start at position 3", id="a gap in positions is refused"),
        pytest.param(0, 0, 9, ContextExceededError, "exceed the context of 8", id="a chunk past the context fails"),
    ],
)
def test_bad_chunks_are_refused_with_a_message(
    slot: int, start: int, length: int, error: type[Exception], message: str
) -> None:
    kv = pool(layers=1, context=8, type_k=CacheType.F16, type_v=CacheType.F16, parallel=2)
    with pytest.raises(error, match=message):
        kv.extend(slot=slot, start_position=start, length=length)
