"""ModelInfo for well-known model shapes, built from their tensor dimensions and a bits-per-weight figure.

Until GGUF headers of these shapes are generated (strata.gguf.testmodels), planner tests and benches describe
models directly. Byte counts follow from the shapes: a Llama-3-70B layer holds 855 M weights (attention
q/k/v/o plus a 28672-wide gated FFN), which is 0.48 GB at Q4_0's 4.5 bits per weight and 0.91 GB at Q8_0's 8.5.
"""

from __future__ import annotations

from strata.gguf.model import ModelInfo, SlidingWindow

Q4_0_BITS = 4.5
Q8_0_BITS = 8.5
F32_BITS = 32


def _tensor_bytes(elements: int, bits: float) -> int:
    return int(elements * bits) // 8


def dense_model(
    *,
    layers: int = 80,
    embd: int = 8192,
    heads: int = 64,
    kv_heads: int = 8,
    head_dim: int = 128,
    ffn: int = 28672,
    vocab: int = 128256,
    context: int = 131072,
    bits: float = Q4_0_BITS,
    tied: bool = False,
    window: SlidingWindow | None = None,
    architecture: str = "llama",
) -> ModelInfo:
    """A llama-family dense model; the defaults are Llama-3-70B's shape."""
    attention = embd * heads * head_dim * 2 + embd * kv_heads * head_dim * 2
    layer = _tensor_bytes(attention + 3 * embd * ffn, bits) + _tensor_bytes(2 * embd, F32_BITS)
    non_layer = {"token_embd": _tensor_bytes(vocab * embd, bits), "output_norm": _tensor_bytes(embd, F32_BITS)}
    if not tied:
        non_layer["output"] = _tensor_bytes(vocab * embd, bits)
    return ModelInfo(
        architecture=architecture,
        block_count=layers,
        embedding_length=embd,
        head_count=heads,
        head_count_kv=(kv_heads,) * layers,
        key_length=head_dim,
        value_length=head_dim,
        context_length=context,
        vocab_size=vocab,
        layer_bytes=(layer,) * layers,
        non_layer_bytes=non_layer,
        output_tied=tied,
        sliding_window=window,
    )


def llama3_70b(*, bits: float = Q4_0_BITS) -> ModelInfo:
    return dense_model(bits=bits)


def llama3_8b(*, bits: float = Q4_0_BITS) -> ModelInfo:
    return dense_model(layers=32, embd=4096, heads=32, kv_heads=8, ffn=14336, bits=bits)


def qwen3_30b_a3b(*, bits: float = Q4_0_BITS) -> ModelInfo:
    """Qwen3-30B-A3B: 48 layers, 128 experts of width 768 (8 used); experts change weights, not KV."""
    layers, embd, experts, expert_ffn = 48, 2048, 128, 768
    attention = embd * 32 * 128 + embd * 4 * 128 * 2 + 32 * 128 * embd
    layer = _tensor_bytes(attention + experts * 3 * embd * expert_ffn + embd * experts, bits)
    model = dense_model(
        layers=layers, embd=embd, heads=32, kv_heads=4, vocab=151936, context=40960, bits=bits, architecture="qwen3moe"
    )
    return ModelInfo(
        **{**model.__dict__, "layer_bytes": (layer,) * layers, "expert_count": experts, "expert_used_count": 8}
    )


def gemma3_like(*, layers: int = 48, window: int = 1024, bits: float = Q4_0_BITS) -> ModelInfo:
    """A gemma3-style model: five sliding-window layers for every full-attention one (SWA iff il % 6 < 5)."""
    pattern = tuple(il % 6 < 5 for il in range(layers))
    return dense_model(
        layers=layers,
        embd=3840,
        heads=16,
        kv_heads=8,
        head_dim=256,
        ffn=15360,
        vocab=262144,
        context=131072,
        bits=bits,
        tied=True,
        window=SlidingWindow(window=window, layers=pattern),
        architecture="gemma3",
    )
