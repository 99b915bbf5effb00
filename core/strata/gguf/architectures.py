"""Every architecture Strata's stages run, as data: how its blocks differ from a llama block, and the GGUF tensors
each part of a block reads.

The stage worker's model (strata.stage_worker.model) and loader read this table and never branch on an architecture's
name; the planner reads its sliding-window pattern, `strata inspect` and the operator its set of names
(strata.gguf.executable), and the README's list of supported architectures is generated from it. Adding an
architecture is an entry here, plus an operation in the model file only where it needs one no entry has yet.

Conventions are llama.cpp's, since it wrote the files: its converter stores Gemma's norm weights with the 1 of
Gemma's `(1 + w)` RMSNorm already added (HF's GGUF loader subtracts it again), so every norm here is a plain RMSNorm
over the file's weights; its RoPE type for each architecture says which rotation matches the order the converter
left q/k rows in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType


class RopeStyle(StrEnum):
    NORM = "norm"  # rotate adjacent pairs (x[2i], x[2i+1]); llama.cpp LLAMA_ROPE_TYPE_NORM
    NEOX = "neox"  # rotate halves (x[i], x[i + d/2]); llama.cpp LLAMA_ROPE_TYPE_NEOX


class Activation(StrEnum):
    SILU = "silu"  # SwiGLU: silu(gate) * up
    GELU_TANH = "gelu_tanh"  # GeGLU with the tanh approximation of GELU: gelu(gate) * up


# A block's parameters (paths inside the stage model's Block) -> the tensors inside blk.N they hold, stacked along
# the rows in this order: the model fuses q/k/v and gate/up into one matrix each.
LLAMA_BLOCK: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "attn_norm.weight": ("attn_norm.weight",),
        "attn.wqkv.weight": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
        "attn.wqkv.bias": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
        "attn.wo.weight": ("attn_output.weight",),
        "attn.q_norm.weight": ("attn_q_norm.weight",),
        "attn.k_norm.weight": ("attn_k_norm.weight",),
        "ffn_norm.weight": ("ffn_norm.weight",),
        "ffn.w_gate_up.weight": ("ffn_gate.weight", "ffn_up.weight"),
        "ffn.w_down.weight": ("ffn_down.weight",),
    }
)
# Phi-3: llama.cpp keeps HF's fused matrices, q/k/v in one (attn_qkv) and gate over up in one of 2 x n_ff rows
# (ffn_up), already in the order the model stacks them.
FUSED_BLOCK: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        **LLAMA_BLOCK,
        "attn.wqkv.weight": ("attn_qkv.weight",),
        "attn.wqkv.bias": ("attn_qkv.bias",),
        "ffn.w_gate_up.weight": ("ffn_up.weight",),
    }
)
# A mixture of experts in place of the feed-forward: the router (one logit per expert), and every expert's gate, up
# and down matrices stacked along a leading expert axis ([n_expert, rows, columns]); gate and up stack along the rows
# of each expert, as the dense block's do.
EXPERT_BLOCK: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "ffn.router.weight": ("ffn_gate_inp.weight",),
        "ffn.w_gate_up": ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
        "ffn.w_down": ("ffn_down_exps.weight",),
    }
)
# The stacked tensors of the routed experts, which a stage holds dequantised (strata.gguf.resident).
STACKED_EXPERT_TENSORS = frozenset(EXPERT_BLOCK["ffn.w_gate_up"] + EXPERT_BLOCK["ffn.w_down"])
# Gemma 2/3's "sandwich" norms: the attention's and the feed-forward's outputs are normed again before the residual.
POST_NORMS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "attn_post_norm.weight": ("post_attention_norm.weight",),
        "ffn_post_norm.weight": ("post_ffw_norm.weight",),
    }
)


@dataclass(frozen=True)
class SlidingPattern:
    """Which layers attend over a sliding window: layer il does iff il % period < sliding (llama.cpp's rule)."""

    period: int
    sliding: int

    def __call__(self, layer: int) -> bool:
        return layer % self.period < self.sliding


@dataclass(frozen=True, kw_only=True)
class Experts:
    """How an architecture's mixture-of-experts blocks route, as llama.cpp's build_moe_ffn does it for that
    architecture: a softmax over the router's logits for every expert, the file's expert_used_count best of them, and
    their weights divided by their sum when `renormalise` (llama.cpp's norm_w, fixed per architecture; HF's
    norm_topk_prob). Mixtral's "softmax over the top-k logits" is the renormalised case. The count and widths come
    from the file ({arch}.expert_count, expert_used_count, expert_feed_forward_length)."""

    renormalise: bool
    required: bool  # every file of the architecture has experts; else only files that state {arch}.expert_count


@dataclass(frozen=True, kw_only=True)
class Architecture:
    name: str  # general.architecture
    family: str  # what a person knows the models as, for the README
    rope_style: RopeStyle
    activation: Activation = Activation.SILU
    embedding_scaled: bool = False  # token embeddings times sqrt(n_embd) (Gemma)
    post_norms: bool = False  # POST_NORMS after attention and feed-forward (Gemma 2/3)
    sliding: SlidingPattern | None = None  # with {arch}.attention.sliding_window from the file
    sliding_rope_base: float | None = None  # RoPE base of sliding layers, fixed by the architecture (Gemma 3)
    sliding_rope_scaled: bool = True  # the file's RoPE scaling applies to sliding layers too (not Gemma 3's)
    rope_freqs: bool = False  # reads llama.cpp's rope_freqs.weight, one divisor per frequency (Llama 3.1's scaling)
    # (attention, final logits) soft-cap defaults when the file states none: x -> cap * tanh(x / cap) (Gemma 2)
    softcaps: tuple[float, float] | None = None
    block_tensors: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: LLAMA_BLOCK)
    experts: Experts | None = None  # the feed-forward may be (or, when required, is) a mixture of experts

    @property
    def tensor_names(self) -> Mapping[str, tuple[str, ...]]:
        """Every block parameter the architecture can have -> its GGUF tensors inside blk.N."""
        experts = EXPERT_BLOCK if self.experts else {}
        return {**self.block_tensors, **(POST_NORMS if self.post_norms else {}), **experts}

    @property
    def features(self) -> tuple[str, ...]:
        """What sets it apart from a llama block, in words, for the README."""
        notes = [f"{self.rope_style} RoPE", "GeGLU" if self.activation is Activation.GELU_TANH else "SwiGLU"]
        notes += ["fused qkv and gate/up matrices"] if self.block_tensors is FUSED_BLOCK else []
        notes += ["embeddings scaled by sqrt(d)"] if self.embedding_scaled else []
        notes += ["4 norms a block"] if self.post_norms else []
        if self.sliding is not None:
            notes.append(f"sliding window on {self.sliding.sliding} of every {self.sliding.period} layers")
        notes += [f"sliding layers' RoPE base {self.sliding_rope_base:g}"] if self.sliding_rope_base else []
        notes += ["RoPE scaling on global layers only"] if self.sliding and not self.sliding_rope_scaled else []
        notes += ["Llama 3.1 RoPE factors (rope_freqs)"] if self.rope_freqs else []
        notes += ["soft-capped attention and logits"] if self.softcaps else []
        if self.experts is not None:
            routing = "softmax router, top-k" + (" renormalised" if self.experts.renormalise else "")
            kind = "mixture of experts" if self.experts.required else "mixture of experts when the file has experts"
            notes.append(f"{kind} ({routing}; experts held dequantised, 2 bytes a weight)")
        return tuple(notes)


ARCHITECTURES: Mapping[str, Architecture] = MappingProxyType(
    {
        a.name: a
        for a in (
            Architecture(
                name="llama",
                family="Llama 2/3/3.1, Mistral, Mixtral (as llama.cpp writes them)",
                rope_style=RopeStyle.NORM,
                rope_freqs=True,
                experts=Experts(renormalise=True, required=False),
            ),
            # llama.cpp's Mistral files say "llama"; a "mistral" file keeps HF's q/k order
            Architecture(name="mistral", family="Mistral", rope_style=RopeStyle.NEOX),
            Architecture(name="qwen2", family="Qwen 2 / 2.5 (q/k/v biases)", rope_style=RopeStyle.NEOX),
            Architecture(name="qwen3", family="Qwen 3 dense (q/k norms)", rope_style=RopeStyle.NEOX),
            # llama.cpp renormalises qwen3moe's top-k weights whatever the file says (HF's GGUF loader sets
            # norm_topk_prob to match); Qwen 3 MoE has no shared expert.
            Architecture(
                name="qwen3moe",
                family="Qwen 3 MoE (q/k norms, experts)",
                rope_style=RopeStyle.NEOX,
                experts=Experts(renormalise=True, required=True),
            ),
            # Phi-3's 128k models ask for LongRoPE, which strata.gguf.rope_scaling refuses by name.
            Architecture(name="phi3", family="Phi-3, Phi-4 mini", rope_style=RopeStyle.NEOX, block_tensors=FUSED_BLOCK),
            Architecture(
                name="gemma2",
                family="Gemma 2",
                rope_style=RopeStyle.NEOX,
                activation=Activation.GELU_TANH,
                embedding_scaled=True,
                post_norms=True,
                sliding=SlidingPattern(period=2, sliding=1),
                softcaps=(50.0, 30.0),
            ),
            Architecture(
                name="gemma3",
                family="Gemma 3 text (q/k norms)",
                rope_style=RopeStyle.NEOX,
                activation=Activation.GELU_TANH,
                embedding_scaled=True,
                post_norms=True,
                sliding=SlidingPattern(period=6, sliding=5),
                sliding_rope_base=10000.0,
                sliding_rope_scaled=False,
            ),
        )
    }
)
