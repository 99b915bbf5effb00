"""The shapes test models are generated in: small executable ones, and header-only copies of real large models.

A ModelShape says what a GGUF file describes (llama.cpp's keys) and `tensor_plan` lists the tensors that go with it,
named and laid out as llama.cpp writes them (ggml dimension order: the row length first). The small shapes keep every
quantised row a multiple of 32 and mix F32 norms, F16, Q8_0 and Q4_0 weights; the large ones use the K-quants real
downloads use, and are written without tensor data, for planning tests.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gguf import GGMLQuantizationType as Q


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    architecture: str
    name: str
    block_count: int
    embedding_length: int
    feed_forward_length: int
    head_count: int
    head_count_kv: int
    head_dim: int
    context_length: int
    rope_freq_base: float
    tokenizer_pre: str
    vocab_size: int | None = None  # None: exactly the trained vocabulary
    rms_epsilon: float = 1e-5
    attention_bias: bool = False  # qwen2: biases on the q, k and v projections
    qk_norm: bool = False  # qwen3: RMS norms on each head's queries and keys
    tied_output: bool = False  # no output.weight: the head reuses token_embd
    write_key_length: bool = False  # state attention.key_length/value_length instead of relying on n_embd / n_head
    expert_count: int = 0
    expert_used_count: int = 0
    expert_feed_forward_length: int = 0  # 0: not stated, the experts are feed_forward_length wide (Mixtral's files)
    shared_expert_feed_forward_length: int = 0  # Qwen 2 MoE's gated shared expert (ffn_*_shexp); 0: none
    sliding_window: int = 0
    post_norms: bool = False  # Gemma 2/3: post_attention_norm and post_ffw_norm in every block
    softcaps: tuple[float, float] | None = None  # Gemma 2: (attention, final logits) soft-caps stated in the file
    quantised: bool = False  # the large shapes: K-quant weights, header only
    # RoPE scaling as a file states it: keys under `{arch}.rope.` (e.g. "scaling.type") written as given, and the
    # values of a rope_freqs.weight tensor (strata.gguf.testmodels.rope makes Llama 3.1's)
    fused: bool = False  # Phi-3: attn_qkv for q/k/v, ffn_up for gate over up (2 x feed_forward_length rows)
    rope_dim: int | None = None  # rope.dimension_count; None: head_dim (a smaller one rotates part of each head)
    rope_keys: tuple[tuple[str, str | float | int], ...] = ()
    rope_freqs: tuple[float, ...] = ()


@dataclass(frozen=True, kw_only=True)
class PlannedTensor:
    name: str
    dims: tuple[int, ...]  # ggml order: dims[0] is the row length
    ggml_type: Q


SMALL_SHAPES: dict[str, ModelShape] = {
    "llama": ModelShape(
        architecture="llama", name="strata-test-llama", block_count=2, embedding_length=128, feed_forward_length=256,
        head_count=4, head_count_kv=2, head_dim=32, context_length=2048, rope_freq_base=500000.0,
        tokenizer_pre="llama-bpe",
    ),
    # llama.cpp writes Mistral models as architecture "llama" (there is no "mistral" in llama.cpp or gguf-py), and
    # transformers 5.23 fails on a file that says "mistral": it looks the name up in gguf-py's architecture table.
    "mistral": ModelShape(
        architecture="llama", name="Strata-Test-Mistral", block_count=2, embedding_length=128,
        feed_forward_length=224, head_count=4, head_count_kv=1, head_dim=32, context_length=4096,
        rope_freq_base=1000000.0, tokenizer_pre="llama-bpe",
    ),
    "qwen2": ModelShape(
        architecture="qwen2", name="strata-test-qwen2", block_count=3, embedding_length=128, feed_forward_length=192,
        head_count=4, head_count_kv=2, head_dim=32, context_length=4096, rope_freq_base=1000000.0,
        tokenizer_pre="qwen2", attention_bias=True, rms_epsilon=1e-6,
    ),
    # transformers reads no head_dim for qwen3 GGUF files and assumes Qwen3's 128, so the test model uses 128.
    "qwen3": ModelShape(
        architecture="qwen3", name="strata-test-qwen3", block_count=2, embedding_length=128, feed_forward_length=256,
        head_count=4, head_count_kv=2, head_dim=128, context_length=8192, rope_freq_base=1000000.0,
        tokenizer_pre="qwen2", qk_norm=True, tied_output=True, write_key_length=True, rms_epsilon=1e-6,
    ),
    # HF reads no query_pre_attn_scalar from a Gemma GGUF and keeps its default of 256, while llama.cpp scales by
    # 1 / sqrt(head_dim): real Gemma 2/3 models (but the 27B) have head_dim 256, so the test models do too. Windows
    # are short so the prompts of the tests outrun them; gemma3 has 7 layers so a global one (layer 5) is among them.
    "gemma2": ModelShape(
        architecture="gemma2", name="strata-test-gemma2", block_count=3, embedding_length=128,
        feed_forward_length=256, head_count=2, head_count_kv=1, head_dim=256, context_length=8192,
        rope_freq_base=10000.0, tokenizer_pre="llama-bpe", tied_output=True, write_key_length=True,
        rms_epsilon=1e-6, sliding_window=8, post_norms=True, softcaps=(50.0, 30.0),
    ),
    "gemma3": ModelShape(
        architecture="gemma3", name="strata-test-gemma3", block_count=7, embedding_length=128,
        feed_forward_length=256, head_count=2, head_count_kv=1, head_dim=256, context_length=32768,
        rope_freq_base=1000000.0, tokenizer_pre="llama-bpe", qk_norm=True, tied_output=True, write_key_length=True,
        rms_epsilon=1e-6, sliding_window=8, post_norms=True,
    ),
    # Mixtures of experts: a Qwen 3 MoE (q/k norms, stated expert width and head width, which HF reads) and a Mixtral
    # as llama.cpp writes it (architecture llama, experts as wide as feed_forward_length, no width stated). The
    # expert counts are odd so that renormalising the top-k weights changes them.
    "qwen3moe": ModelShape(
        architecture="qwen3moe", name="strata-test-qwen3moe", block_count=3, embedding_length=128,
        feed_forward_length=256, head_count=4, head_count_kv=2, head_dim=32, context_length=8192,
        rope_freq_base=1000000.0, tokenizer_pre="qwen2", qk_norm=True, write_key_length=True, rms_epsilon=1e-6,
        expert_count=8, expert_used_count=3, expert_feed_forward_length=64,
    ),
    "mixtral": ModelShape(
        architecture="llama", name="strata-test-mixtral", block_count=3, embedding_length=128,
        feed_forward_length=96, head_count=4, head_count_kv=2, head_dim=32, context_length=4096,
        rope_freq_base=1000000.0, tokenizer_pre="llama-bpe", expert_count=5, expert_used_count=2,
    ),
    # Phi-3 as llama.cpp writes it: fused matrices, no biases; Phi-4 mini's partial rotation is a test case's.
    "phi3": ModelShape(
        architecture="phi3", name="strata-test-phi3", block_count=2, embedding_length=128, feed_forward_length=192,
        head_count=4, head_count_kv=2, head_dim=32, context_length=4096, rope_freq_base=10000.0,
        tokenizer_pre="llama-bpe", fused=True,
    ),
}  # fmt: skip


# A llama small enough for CPU tests whose every row is a whole number of 256-value K-quant blocks.
K_QUANT_SHAPE = ModelShape(
    architecture="llama", name="strata-test-llama-k", block_count=2, embedding_length=256, feed_forward_length=512,
    head_count=8, head_count_kv=2, head_dim=32, context_length=2048, rope_freq_base=500000.0, tokenizer_pre="llama-bpe",
)  # fmt: skip


def bench_llama(*, layers: int, context_length: int | None = None) -> ModelShape:
    """A llama of realistic width (hidden 1024, 16 heads over 8 KV heads) with few layers: what the CPU benchmarks
    run, wide enough that per-token costs look like a real model's and small enough for two cores."""
    shape = dataclasses.replace(
        SMALL_SHAPES["llama"],
        name="strata-bench-llama",
        block_count=layers,
        embedding_length=1024,
        feed_forward_length=2816,
        head_count=16,
        head_count_kv=8,
        head_dim=64,
    )
    return shape if context_length is None else dataclasses.replace(shape, context_length=context_length)


LARGE_SHAPES: dict[str, ModelShape] = {
    "llama3-8b": ModelShape(
        architecture="llama", name="Llama-3-8B-like", block_count=32, embedding_length=4096,
        feed_forward_length=14336, head_count=32, head_count_kv=8, head_dim=128, context_length=8192,
        rope_freq_base=500000.0, tokenizer_pre="llama-bpe", vocab_size=128256, quantised=True,
    ),
    "llama3-70b": ModelShape(
        architecture="llama", name="Llama-3-70B-like", block_count=80, embedding_length=8192,
        feed_forward_length=28672, head_count=64, head_count_kv=8, head_dim=128, context_length=131072,
        rope_freq_base=500000.0, tokenizer_pre="llama-bpe", vocab_size=128256, quantised=True,
    ),
    "qwen3-30b-a3b": ModelShape(
        architecture="qwen3moe", name="Qwen3-30B-A3B-like", block_count=48, embedding_length=2048,
        feed_forward_length=6144, head_count=32, head_count_kv=4, head_dim=128, context_length=40960,
        rope_freq_base=1000000.0, tokenizer_pre="qwen2", vocab_size=151936, qk_norm=True, write_key_length=True,
        expert_count=128, expert_used_count=8, expert_feed_forward_length=768, quantised=True, rms_epsilon=1e-6,
    ),
}  # fmt: skip


def tensor_plan(shape: ModelShape, *, vocab_size: int) -> list[PlannedTensor]:
    """Every tensor of `shape`, in the order llama.cpp writes them."""

    def small_or(small: Q, large: Q) -> Q:
        return large if shape.quantised else small

    n_embd, n_q, n_kv = shape.embedding_length, shape.head_count * shape.head_dim, shape.head_count_kv * shape.head_dim
    plan = [PlannedTensor(name="token_embd.weight", dims=(n_embd, vocab_size), ggml_type=small_or(Q.F16, Q.Q4_K))]
    for il in range(shape.block_count):
        blk = f"blk.{il}"
        layer: list[tuple[str, tuple[int, ...], Q]] = [(f"{blk}.attn_norm.weight", (n_embd,), Q.F32)]
        if shape.fused:
            layer += [(f"{blk}.attn_qkv.weight", (n_embd, n_q + 2 * n_kv), small_or(Q.Q8_0, Q.Q4_K))]
        else:
            layer += [
                (f"{blk}.attn_q.weight", (n_embd, n_q), small_or(Q.Q8_0, Q.Q4_K)),
                (f"{blk}.attn_k.weight", (n_embd, n_kv), small_or(Q.Q8_0, Q.Q4_K)),
                (f"{blk}.attn_v.weight", (n_embd, n_kv), small_or(Q.Q4_0, Q.Q6_K)),
            ]
        layer += [
            (f"{blk}.attn_output.weight", (n_q, n_embd), small_or(Q.Q4_0, Q.Q4_K)),
            (f"{blk}.ffn_norm.weight", (n_embd,), Q.F32),
        ]
        if shape.attention_bias:
            layer += [(f"{blk}.attn_{p}.bias", (n,), Q.F32) for p, n in (("q", n_q), ("k", n_kv), ("v", n_kv))]
        if shape.qk_norm:
            layer += [(f"{blk}.attn_{p}_norm.weight", (shape.head_dim,), Q.F32) for p in ("q", "k")]
        if shape.post_norms:
            layer += [(f"{blk}.{name}.weight", (n_embd,), Q.F32) for name in ("post_attention_norm", "post_ffw_norm")]
        if shape.expert_count:
            n_exp, n_ff = shape.expert_count, shape.expert_feed_forward_length or shape.feed_forward_length
            layer += [
                (f"{blk}.ffn_gate_inp.weight", (n_embd, n_exp), Q.F32),
                (f"{blk}.ffn_gate_exps.weight", (n_embd, n_ff, n_exp), small_or(Q.Q8_0, Q.Q4_K)),
                (f"{blk}.ffn_up_exps.weight", (n_embd, n_ff, n_exp), small_or(Q.Q4_0, Q.Q4_K)),
                (f"{blk}.ffn_down_exps.weight", (n_ff, n_embd, n_exp), small_or(Q.F16, Q.Q6_K)),
            ]
            if n_sh := shape.shared_expert_feed_forward_length:
                layer += [
                    (f"{blk}.ffn_gate_inp_shexp.weight", (n_embd,), Q.F32),
                    (f"{blk}.ffn_gate_shexp.weight", (n_embd, n_sh), Q.Q8_0),
                    (f"{blk}.ffn_up_shexp.weight", (n_embd, n_sh), Q.Q8_0),
                    (f"{blk}.ffn_down_shexp.weight", (n_sh, n_embd), Q.Q8_0),
                ]
        elif shape.fused:
            n_ff = shape.feed_forward_length
            layer += [
                (f"{blk}.ffn_up.weight", (n_embd, 2 * n_ff), small_or(Q.Q4_0, Q.Q4_K)),
                (f"{blk}.ffn_down.weight", (n_ff, n_embd), small_or(Q.F16, Q.Q6_K)),
            ]
        else:
            n_ff = shape.feed_forward_length
            layer += [
                (f"{blk}.ffn_gate.weight", (n_embd, n_ff), small_or(Q.Q4_0, Q.Q4_K)),
                (f"{blk}.ffn_up.weight", (n_embd, n_ff), small_or(Q.Q8_0, Q.Q4_K)),
                (f"{blk}.ffn_down.weight", (n_ff, n_embd), small_or(Q.F16, Q.Q6_K)),
            ]
        plan += [PlannedTensor(name=name, dims=dims, ggml_type=t) for name, dims, t in layer]
    if shape.rope_freqs:
        plan.append(PlannedTensor(name="rope_freqs.weight", dims=(len(shape.rope_freqs),), ggml_type=Q.F32))
    plan.append(PlannedTensor(name="output_norm.weight", dims=(n_embd,), ggml_type=Q.F32))
    if not shape.tied_output:
        plan.append(PlannedTensor(name="output.weight", dims=(n_embd, vocab_size), ggml_type=small_or(Q.Q8_0, Q.Q6_K)))
    return plan
