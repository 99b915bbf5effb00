"""ModelInfo for well-known model shapes, built from their tensor dimensions and the type their weights are in.

Until GGUF headers of these shapes are generated (strata.gguf.testmodels), planner tests and benches describe
models directly. Byte counts follow from the shapes: a Llama-3-70B layer holds 855 M weights (attention
q/k/v/o plus a 28672-wide gated FFN), which is 0.48 GB in the file at Q4_0's 4.5 bits per weight and 0.91 GB at
Q8_0's 8.5. A stage keeps both in their blocks, at the same size (strata.gguf.resident); norms are F32 in the file
and 2 bytes per element on a GPU.
"""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from strata.gguf.model import ModelInfo, SlidingWindow
from strata.gguf.resident import resident_bytes

Q4_0 = GGMLQuantizationType.Q4_0
Q8_0 = GGMLQuantizationType.Q8_0
F16 = GGMLQuantizationType.F16
F32 = GGMLQuantizationType.F32


class _Bytes:
    """File and GPU-resident bytes of a group of tensors, added up one tensor at a time."""

    def __init__(self) -> None:
        self.stored = 0
        self.resident = 0

    def add(self, elements: int, ggml_type: GGMLQuantizationType, *, experts: bool = False) -> _Bytes:
        """`experts`: the group is a mixture's stacked experts, which a stage holds otherwise than other matrices."""
        block_elements, block_bytes = GGML_QUANT_SIZES[ggml_type]
        stored = elements // block_elements * block_bytes
        self.stored += stored
        name = "blk.0.ffn_up_exps.weight" if experts else "blk.0.ffn_up.weight"
        self.resident += resident_bytes(ggml_type, name=name, elements=elements, stored_bytes=stored)
        return self


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
    weight_type: GGMLQuantizationType = Q4_0,
    tied: bool = False,
    window: SlidingWindow | None = None,
    architecture: str = "llama",
) -> ModelInfo:
    """A llama-family dense model; the defaults are Llama-3-70B's shape."""
    attention = embd * heads * head_dim * 2 + embd * kv_heads * head_dim * 2
    layer = _Bytes().add(attention + 3 * embd * ffn, weight_type).add(2 * embd, F32)
    non_layer = {"token_embd": _Bytes().add(vocab * embd, weight_type), "output_norm": _Bytes().add(embd, F32)}
    if not tied:
        non_layer["output"] = _Bytes().add(vocab * embd, weight_type)
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
        layer_bytes=(layer.stored,) * layers,
        non_layer_bytes={role: group.stored for role, group in non_layer.items()},
        layer_resident_bytes=(layer.resident,) * layers,
        non_layer_resident_bytes={role: group.resident for role, group in non_layer.items()},
        output_tied=tied,
        sliding_window=window,
    )


def llama3_70b(*, weight_type: GGMLQuantizationType = Q4_0) -> ModelInfo:
    return dense_model(weight_type=weight_type)


def llama3_8b(*, weight_type: GGMLQuantizationType = Q4_0) -> ModelInfo:
    return dense_model(layers=32, embd=4096, heads=32, kv_heads=8, ffn=14336, weight_type=weight_type)


def qwen3_30b_a3b(*, weight_type: GGMLQuantizationType = Q4_0) -> ModelInfo:
    """Qwen3-30B-A3B: 48 layers, 128 experts of width 768 (8 used); experts change weights, not KV. A stage holds the
    experts dequantised to 2 bytes per weight (strata.gguf.resident)."""
    layers, embd, experts, expert_ffn = 48, 2048, 128, 768
    attention = embd * 32 * 128 + embd * 4 * 128 * 2 + 32 * 128 * embd
    layer = (
        _Bytes()
        .add(attention + embd * experts, weight_type)
        .add(experts * 3 * embd * expert_ffn, weight_type, experts=True)
    )
    model = dense_model(
        layers=layers,
        embd=embd,
        heads=32,
        kv_heads=4,
        vocab=151936,
        context=40960,
        weight_type=weight_type,
        architecture="qwen3moe",
    )
    per_layer = {"layer_bytes": (layer.stored,) * layers, "layer_resident_bytes": (layer.resident,) * layers}
    return ModelInfo(**{**model.__dict__, **per_layer, "expert_count": experts, "expert_used_count": 8})


def gemma3_like(*, layers: int = 48, window: int = 1024, weight_type: GGMLQuantizationType = Q4_0) -> ModelInfo:
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
        weight_type=weight_type,
        tied=True,
        window=SlidingWindow(window=window, layers=pattern),
        architecture="gemma3",
    )
