"""The fused RoPE-and-write kernel (strata.stage_worker.kernels.kv_write.rope_write_kv) against its reference, the
path the CPU runs: Rope.apply on q and k, then the pool's own writes. Every cache type, both RoPE styles, a partial
rotation, GQA, rows that are views of the qkv projection's output, and extreme values. Without a GPU the kernel runs
under Triton's interpreter.

Not bit for bit: on a GPU the kernel contracts a * cos - b * sin into one fused multiply-add where the reference rounds
the product first. That error is an ulp of the pair's size, not of the result's (which cancels to near zero where
a cos ~ b sin), so the bound scales with each head's largest value; a q8_0 value that sits on a rounding edge may move
by one step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from strata.gguf.architectures import RopeStyle
from strata.gguf.model import CacheType
from strata.stage_worker.kernels.kv_write import rope_write_kv, rotate_and_write
from strata.stage_worker.kv_stores import LayerCache, Store
from strata.stage_worker.model_config import ModelConfig
from strata.stage_worker.rope import Rope
from torch import Tensor

CELLS = 24


def _normal(shape: tuple[int, ...], g: torch.Generator) -> Tensor:
    return torch.randn(shape, generator=g)


def _extremes(shape: tuple[int, ...], g: torch.Generator) -> Tensor:
    """Huge, tiny and ordinary values side by side, and a zero head."""
    scales = torch.tensor([3e4, 1e-20, 1.0, -2e3])[torch.arange(shape[-1]) % 4]
    x = torch.randn(shape, generator=g).clamp(-1, 1) * scales
    x[:, 0] = 0.0
    return x


@dataclass(frozen=True)
class Case:
    name: str
    cache: CacheType = CacheType.Q8_0
    style: RopeStyle = RopeStyle.NORM
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    rope_dim: int = 64
    rows: int = 3
    dtype: torch.dtype = torch.float16
    values: Callable[[tuple[int, ...], torch.Generator], Tensor] = _normal


# bf16 compute on a GPU only: Triton's interpreter has no bfloat16 (it rounds differently from torch).
BF16_CASES = [
    Case("bf16 compute, q8_0", dtype=torch.bfloat16, rows=5),
    Case("bf16 compute, halves, partial rotation", dtype=torch.bfloat16, style=RopeStyle.NEOX, rope_dim=32),
]
CASES = [
    Case("q8_0, adjacent pairs, one decode row", rows=1),
    Case("q8_0, halves", style=RopeStyle.NEOX),
    Case("q8_0, a prefill chunk", rows=9),
    Case("q8_0, partial rotation (first half of each head)", style=RopeStyle.NEOX, rope_dim=32),
    Case("q8_0, no GQA, head dim 128", heads=2, kv_heads=2, head_dim=128, rope_dim=128),
    Case("q8_0, extreme values", values=_extremes),
    Case("f16 pool", cache=CacheType.F16),
    Case("bf16 pool, halves", cache=CacheType.BF16, style=RopeStyle.NEOX),
    Case("f32 pool, f32 compute, extreme values", cache=CacheType.F32, dtype=torch.float32, values=_extremes),
    Case("f32 pool, f32 compute", cache=CacheType.F32, dtype=torch.float32),
    Case("f16 pool, head dim 48 (not a multiple of 32)", cache=CacheType.F16, head_dim=48, rope_dim=48),
]


def _rope(case: Case, device: torch.device) -> Rope:
    config = ModelConfig(
        architecture="test", n_layer=1, dim=case.heads * case.head_dim, n_head=case.heads, n_head_kv=case.kv_heads,
        head_dim=case.head_dim, ffn_dim=8, vocab_size=8, norm_eps=1e-6, rope_theta=10000.0, rope_dim=case.rope_dim,
        rope_style=case.style, attention_bias=False, qk_norm=False, tied_output=False,
    )  # fmt: skip
    return Rope(config, device=device)


def _cache(case: Case, device: torch.device) -> LayerCache:
    width = case.kv_heads * case.head_dim
    stores = [Store(cache_type=case.cache, cells=CELLS, width=width, device=device) for _ in range(2)]
    return LayerCache(keys=stores[0], values=stores[1], dtype=case.dtype)


def _close(got: Tensor, expected: Tensor, dtype: torch.dtype, what: str, *, head_dim: int) -> None:
    """Within four ulps of `dtype` of the largest value of each head (see the module's docstring)."""
    expected = expected.float().reshape(expected.shape[0], -1, head_dim)
    size = expected.abs().amax(dim=-1, keepdim=True)  # [N, heads, 1]
    error = (got.cpu().float().reshape(expected.shape) - expected).abs()
    bound = 4 * torch.finfo(dtype).eps * size
    worst = float((error / bound.clamp_min(torch.finfo(torch.float32).tiny)).max())
    assert bool((error <= bound).all()), f"{what}: an error {worst:.1f}x the bound of 4 ulps of its head's size"


@pytest.mark.parametrize("case", CASES + (BF16_CASES if torch.cuda.is_available() else []), ids=lambda c: c.name)
def test_the_kernel_rotates_and_stores_what_the_reference_does(case: Case, device: torch.device) -> None:
    g = torch.Generator().manual_seed(11)
    n, width = case.rows, case.kv_heads * case.head_dim
    # q, k and v as views of one projection output, the way the model hands them over.
    qkv = case.values((n, case.heads * case.head_dim + 2 * width), g).to(case.dtype)
    q, k, v = torch.split(qkv, [case.heads * case.head_dim, width, width], dim=-1)
    q = q.view(n, case.heads, case.head_dim)
    k, v = k.view(n, case.kv_heads, case.head_dim), v.view(n, case.kv_heads, case.head_dim)
    positions = torch.randint(0, 40_000, (n,), generator=g)
    cells = torch.randperm(CELLS, generator=g)[:n]

    reference_rope, reference_cache = _rope(case, torch.device("cpu")), _cache(case, torch.device("cpu"))
    cos, sin = reference_rope.angles(positions)
    expected_q = rotate_and_write(q=q, k=k, v=v, cos=cos, sin=sin, cells=cells, cache=reference_cache,
                                  rope=reference_rope)  # fmt: skip

    # The same angles for both: the GPU's cos of a large angle is not the CPU's to the ulp.
    rope, cache = _rope(case, device), _cache(case, device)
    got_q = rope_write_kv(q=q.to(device), k=k.to(device), v=v.to(device), cos=cos.to(device), sin=sin.to(device),
                          cells=cells.to(device), cache=cache, rope=rope)  # fmt: skip

    _close(got_q, expected_q, case.dtype, "q", head_dim=case.head_dim)
    stores = (("keys", cache.keys, reference_cache.keys), ("values", cache.values, reference_cache.values))
    for name, got, expected in stores:
        if expected.scales is None:
            _close(got.values, expected.values, got.values.dtype, name, head_dim=case.head_dim)
            continue
        assert got.scales is not None
        torch.testing.assert_close(got.scales.cpu().float(), expected.scales.float(), rtol=1e-2, atol=0.0)
        steps = (got.values.cpu().int() - expected.values.int()).abs()
        assert int(steps.max()) <= 1, f"{name}: a q8_0 value {int(steps.max())} steps from the reference's"
        assert float((steps > 0).float().mean()) < 0.1, f"{name}: too many q8_0 values off the reference's"


def test_rows_are_not_rotated_past_rope_dim(device: torch.device) -> None:
    """The features of a head past rope_dim leave the kernel exactly as they came (a partial rotation)."""
    case = Case("partial", cache=CacheType.F32, dtype=torch.float32, style=RopeStyle.NEOX, rope_dim=32, rows=2)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, case.heads, case.head_dim, generator=g)
    k = torch.randn(2, case.kv_heads, case.head_dim, generator=g)
    rope, cache = _rope(case, device), _cache(case, device)
    cos, sin = rope.angles(torch.tensor([5, 900], device=device))
    rotated = rope_write_kv(q=q.to(device), k=k.to(device), v=k.to(device), cos=cos, sin=sin,
                            cells=torch.tensor([0, 1], device=device), cache=cache, rope=rope).cpu()  # fmt: skip
    assert torch.equal(rotated[..., 32:], q[..., 32:])
    assert not torch.allclose(rotated[..., :32], q[..., :32])
