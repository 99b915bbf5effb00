"""Usable memory, the KV budget, and the context arithmetic: each rule as a table of named cases."""

from __future__ import annotations

import pytest
from strata.fit import ContextSnap, candidate_contexts, snap_down
from strata.gguf.model import CacheType
from strata.kv_layout import BLOCK_TOKENS
from strata.operator.planner.memory import (
    RUNTIME_OVERHEAD_BYTES,
    buffer_bytes,
    headroom_bytes,
    kv_budget_bytes,
    usable_bytes,
)
from strata.operator.planner.options import PlanOptions
from strata.operator.planner.profile import ModelProfile
from strata.plan import Backend
from strata_testbed.model_shapes import gemma3_like, llama3_8b, llama3_70b

GIB = 1 << 30


@pytest.mark.parametrize(
    ("memory", "backend", "fraction", "headroom"),
    [
        pytest.param(80 * GIB, Backend.CUDA, 0.10, 8 * GIB, id="a large GPU keeps ten percent free by default"),
        pytest.param(
            8 * GIB,
            Backend.CUDA,
            0.10,
            RUNTIME_OVERHEAD_BYTES[Backend.CUDA],
            id="a small GPU keeps at least the CUDA runtime overhead",
        ),
        pytest.param(
            12 * GIB,
            Backend.ROCM,
            0.10,
            RUNTIME_OVERHEAD_BYTES[Backend.ROCM],
            id="ROCm's overhead is larger than ten percent of 12 GiB",
        ),
        pytest.param(
            8 * GIB, Backend.XPU, 0.10, RUNTIME_OVERHEAD_BYTES[Backend.XPU], id="XPU keeps its runtime overhead"
        ),
        pytest.param(80 * GIB, Backend.CUDA, 0.25, 20 * GIB, id="a headroom override sets the share"),
        pytest.param(
            80 * GIB,
            Backend.CUDA,
            0.0,
            RUNTIME_OVERHEAD_BYTES[Backend.CUDA],
            id="a zero headroom override still keeps the runtime overhead",
        ),
    ],
)
def test_headroom_is_a_share_of_memory_but_never_below_the_runtime_overhead(
    memory: int, backend: Backend, fraction: float, headroom: int
) -> None:
    assert headroom_bytes(memory_bytes=memory, backend=backend, fraction=fraction) == headroom
    assert usable_bytes(memory_bytes=memory, backend=backend, fraction=fraction) == memory - headroom


@pytest.mark.parametrize(
    ("usable", "weights", "buffers", "budget"),
    [
        pytest.param(100, 30, 10, 51, id="the KV budget is 85 percent of what weights and buffers leave"),
        pytest.param(100, 95, 10, 0, id="no KV budget when weights and buffers already overflow"),
    ],
)
def test_the_kv_budget_keeps_fifteen_percent_spare(usable: int, weights: int, buffers: int, budget: int) -> None:
    assert kv_budget_bytes(usable=usable, weights=weights, buffers=buffers) == budget


def test_only_the_last_stage_pays_for_the_logits_buffer() -> None:
    model = llama3_70b()
    assert buffer_bytes(model=model, output_head=True) - buffer_bytes(model=model, output_head=False) == (
        512 * model.vocab_size * 4
    )


def test_kv_cache_defaults_to_q8_0_for_keys_and_values() -> None:
    options = PlanOptions()
    assert (options.cache_type_k, options.cache_type_v) == (CacheType.Q8_0, CacheType.Q8_0)


@pytest.mark.parametrize(
    ("tokens", "snap", "snapped"),
    [
        pytest.param(131072, ContextSnap.STEP, 131072, id="a multiple of 256 is kept"),
        pytest.param(92500, ContextSnap.STEP, 92416, id="steps of 256 round down"),
        pytest.param(92500, ContextSnap.POWER_OF_TWO, 65536, id="powers of two round down"),
        pytest.param(700, ContextSnap.STEP, 512, id="just above the floor snaps to the floor"),
        pytest.param(511, ContextSnap.STEP, 0, id="below the floor of 512 nothing is offered"),
        pytest.param(511, ContextSnap.POWER_OF_TWO, 0, id="below the floor nothing is offered in powers of two"),
    ],
)
def test_context_snaps_down_to_a_tidy_value_with_a_floor(tokens: int, snap: ContextSnap, snapped: int) -> None:
    assert snap_down(tokens, snap=snap) == snapped


@pytest.mark.parametrize(
    ("native", "snap", "first", "last", "count"),
    [
        pytest.param(8192, ContextSnap.STEP, 512, 8192, 31, id="steps of 256 from the floor to the native context"),
        pytest.param(40960, ContextSnap.POWER_OF_TWO, 512, 32768, 7, id="powers of two never pass the native context"),
        pytest.param(300, ContextSnap.STEP, 300, 300, 1, id="a native context below the floor is offered as is"),
    ],
)
def test_candidate_contexts_run_from_the_floor_to_the_native_context(
    native: int, snap: ContextSnap, first: int, last: int, count: int
) -> None:
    contexts = candidate_contexts(native=native, snap=snap)
    assert (contexts[0], contexts[-1], len(contexts)) == (first, last, count)


@pytest.mark.parametrize(
    ("start", "end"),
    [
        pytest.param(0, 32, id="the whole model uses layer fraction 1.0"),
        pytest.param(0, 8, id="a first stage counts only its own eight layers"),
        pytest.param(20, 32, id="a last stage counts only its own twelve layers"),
    ],
)
def test_a_stage_counts_kv_only_for_its_own_layers(start: int, end: int) -> None:
    model = llama3_8b()
    profile = ModelProfile.of(model, type_k=CacheType.Q8_0, type_v=CacheType.Q8_0, parallel=1)
    per_token = model.kv_bytes_per_token(type_k=CacheType.Q8_0, type_v=CacheType.Q8_0)
    assert profile.kv_bytes(start, end, 4096) == 4096 * per_token * (end - start) // 32


@pytest.mark.parametrize(
    ("parallel", "context"),
    [
        pytest.param(1, 32768, id="one lane"),
        pytest.param(4, 32768, id="four lanes share the same pool, a partial block each beyond the first"),
        pytest.param(16, 32768, id="sixteen lanes share the same pool, a partial block each beyond the first"),
    ],
)
def test_parallel_lanes_do_not_multiply_kv_memory(parallel: int, context: int) -> None:
    model = llama3_70b()
    profile = ModelProfile.of(model, type_k=CacheType.Q8_0, type_v=CacheType.Q8_0, parallel=parallel)
    assert profile.kv_bytes(0, 80, context) == (context + (parallel - 1) * BLOCK_TOKENS) * 174080


@pytest.mark.parametrize(
    ("parallel", "context", "start", "end"),
    [
        pytest.param(1, 131072, 0, 48, id="sliding-window layers hold window plus ubatch cells at long context"),
        pytest.param(4, 131072, 0, 48, id="sliding-window cells grow with the lanes"),
        pytest.param(4, 1024, 0, 48, id="below the window every layer holds the whole context"),
        pytest.param(2, 65536, 5, 29, id="a span starting mid-pattern counts its own sliding layers"),
    ],
)
def test_sliding_window_kv_matches_the_model_description(parallel: int, context: int, start: int, end: int) -> None:
    model = gemma3_like()
    profile = ModelProfile.of(model, type_k=CacheType.Q8_0, type_v=CacheType.F16, parallel=parallel)
    expected = model.kv_bytes(
        n_ctx=context, type_k=CacheType.Q8_0, type_v=CacheType.F16, layers=range(start, end), n_seq=parallel
    )
    assert profile.kv_bytes(start, end, context) == expected


def test_sliding_window_layers_need_far_less_kv_than_full_ones_at_long_context() -> None:
    model = gemma3_like()
    profile = ModelProfile.of(model, type_k=CacheType.Q8_0, type_v=CacheType.Q8_0, parallel=4)
    full = 131072 * model.kv_bytes_per_token(type_k=CacheType.Q8_0, type_v=CacheType.Q8_0)
    assert profile.kv_bytes(0, 48, 131072) < full // 4
