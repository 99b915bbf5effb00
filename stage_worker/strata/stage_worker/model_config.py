"""A stage model's configuration: the file's shapes and the architecture table's differences as fields, with the
figures derived from them (strata.stage_worker.loader fills it from the GGUF header)."""

from __future__ import annotations

from dataclasses import dataclass

from strata.gguf.architectures import Activation, RopeStyle
from strata.stage_worker.kernels.paged_attention import AttentionRule


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    n_layer: int
    dim: int
    n_head: int
    n_head_kv: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    norm_eps: float
    rope_theta: float
    rope_dim: int
    rope_style: RopeStyle
    attention_bias: bool  # qwen2: q/k/v projections carry a bias
    qk_norm: bool  # qwen3: RMSNorm over each head of q and k before RoPE
    tied_output: bool  # no output.weight: the head reuses token_embd
    activation: Activation = Activation.SILU
    embedding_scale: float = 1.0  # Gemma: sqrt(dim)
    post_norms: bool = False  # Gemma: the attention's and feed-forward's outputs are normed before the residual
    sliding_window: int = 0  # tokens a sliding layer sees, itself included; 0: no sliding layers
    sliding_layers: tuple[bool, ...] = ()  # per layer of the whole model: attends over the window only
    sliding_rope_theta: float | None = None  # RoPE base of sliding layers; None: rope_theta
    rope_scale: float = 1.0  # linear RoPE scaling: positions divided by it
    rope_freqs: bool = False  # the file's rope_freqs.weight divides each frequency (Llama 3.1)
    sliding_rope_scaled: bool = True  # the two above apply to sliding layers too
    attention_softcap: float = 0.0  # Gemma 2: scores -> cap * tanh(scores / cap); 0: none
    final_softcap: float = 0.0  # Gemma 2: the same on the output logits
    n_expert: int = 0  # a mixture of this many experts in place of the feed-forward; 0: a dense feed-forward
    n_expert_used: int = 0  # experts each row goes through (top-k)
    expert_ffn_dim: int = 0  # each expert's hidden width
    renormalise_experts: bool = False  # the k weights are divided by their sum (llama.cpp's norm_w)

    @property
    def attention_scale(self) -> float:
        """Scores are q.k times this. llama.cpp's rule for every architecture here (Gemma's 27B models, which scale
        by n_embd / n_head instead, would need a table field)."""
        return float(self.head_dim**-0.5)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_layers) and self.sliding_layers[layer]

    def attention_rule(self, layer: int) -> AttentionRule:
        window = self.sliding_window if self.is_sliding(layer) else 0
        return AttentionRule(scale=self.attention_scale, window=window, softcap=self.attention_softcap)

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def n_rep(self) -> int:
        return self.n_head // self.n_head_kv
