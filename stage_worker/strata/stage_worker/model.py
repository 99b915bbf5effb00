"""The decoder of every architecture in strata.gguf.architectures as one stage runs it: a contiguous slice of layers.

Read top to bottom: the step's layout, attention with a paged KV pool (optionally over a sliding window, with
soft-capped scores), the feed-forward (or a mixture of experts, strata.stage_worker.experts), the block (two norms,
or Gemma's four), and the stage module that owns the
embedding (first stage), its layers, and the final norm and output head (last stage). The config
(strata.stage_worker.model_config) holds the architecture's differences as fields filled from the architecture
table, never branches on a model name; RoPE lives in strata.stage_worker.rope.

Weights keep llama.cpp's layout from the GGUF file. llama.cpp's converter permutes attn_q/attn_k rows of llama
models so that RoPE rotates adjacent pairs ("normal" RoPE); qwen2/qwen3 keep HF's order and rotate the two halves
("neox" RoPE). Applying the matching rotation to the file's weights computes the same function as HF on the
un-permuted weights.

The model is built on the meta device with plain nn.Linear/nn.Embedding shapes; the loader (strata.stage_worker.
loader) puts in their place the matrices as the stage keeps them (strata.stage_worker.weights.linear: quantised
blocks or plain values) and assigns the other parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from strata.gguf.architectures import Activation
from strata.stage_worker.experts import MixtureOfExperts
from strata.stage_worker.kernels import norms_and_gates
from strata.stage_worker.kernels.kv_write import rotate_and_write
from strata.stage_worker.kernels.paged_attention import AttentionRule, Sequences, attend_fresh, attend_pool
from strata.stage_worker.kernels.quant_matmul import Gate
from strata.stage_worker.kv_stores import LayerCache
from strata.stage_worker.model_config import ModelConfig
from strata.stage_worker.rope import Rope
from strata.stage_worker.weights.linear import PackedLinear, joined, split_columns
from torch import Tensor, nn

# A mixture's experts' activations (strata.stage_worker.experts).
ACTIVATIONS: dict[Activation, Callable[[Tensor], Tensor]] = {
    Activation.SILU: F.silu,
    Activation.GELU_TANH: partial(F.gelu, approximate="tanh"),
}
# The dense feed-forward's: act(gate) * up in f32, rounded once, wherever it is formed (the products' loads or stores,
# norms_and_gates.activate).
GATES: dict[Activation, Gate] = {Activation.SILU: Gate.SILU, Activation.GELU_TANH: Gate.GELU_TANH}


@dataclass(frozen=True)
class Layout:
    """Everything a layer needs about a step, computed once per step: each row's position and new cell, and the step's
    sequences (a slot's rows and how many of its positions they see), which attention reads in place from the pool.

    One attention call serves any mix a step carries: prefill chunks from position 0 and after cached positions, decode
    rows, verified drafts. Measured on an H200 (2026-11-28, Gemma 3 270M): a step of 16 new prompts of 142 tokens took
    150 ms when each fresh chunk attended on its own (flash attention, or a masked SDPA under a window), launch-bound
    with 18.9 ms of GPU work, the 288 calls of 16 chunks by 18 layers each copying and casting its keys. Every field is
    a device tensor, and a decode step's shapes follow its batch size alone (and the rows a slot), so it is captured
    once per batch size in a CUDA graph and replayed at any depth.
    """

    positions: Tensor  # [N] absolute position of each row
    write_cells: Tensor  # [N] pool cell each row's K/V goes to
    table: Tensor  # [parallel, context] the pool's table: the cells of each slot's positions
    sequences: Sequences  # sequence i: slot slots[i]'s rows, seeing positions 0..its last row's
    window: Layout | None = None  # the same step in the sliding-window layers' cells, when they have their own
    # A CUDA step that is one prompt from position 0 of FLASH_MIN_ROWS rows or more: its cells, in order. Its layers
    # without a window or a soft-cap attend through flash attention over those cells, read once: on an H200
    # (2026-11-29, Llama-3-8B shape, q8_0 KV) the pool kernel took 1.18 ms a layer over a 4,096-token prompt, 38 of
    # the 166 ms to its first token, where flash attention had taken a few (146 ms to the first token before all
    # chunks went to the pool kernel). Many short prompts in one step are the pool kernel's (see above).
    fresh: Tensor | None = None
    # A one-row decode step over a resident window: each row's slot, under which attention records the row's query
    # (LayerCache.queries) for the window's next choice of blocks (strata.stage_worker.kv_resident).
    recorded: Tensor | None = None

    def attend(self, q: Tensor, cache: LayerCache, config: ModelConfig, rule: AttentionRule) -> Tensor:
        if self.fresh is not None and not rule.window and not rule.softcap:
            return attend_fresh(q, cache, cells=self.fresh, n_head_kv=config.n_head_kv, rule=rule)
        return attend_pool(q, cache, table=self.table, sequences=self.sequences, n_head_kv=config.n_head_kv, rule=rule)


FLASH_MIN_ROWS = 1024  # a lone fresh prompt this long attends through flash attention (Layout.fresh)


def step_layout(
    *, positions: Tensor, write_cells: Tensor, chunks: Sequence[tuple[int, int, int]], table: Tensor
) -> Layout:
    """The layout of a step of any chunks: (slot, start position, length) each, in the order of the step's rows."""
    columns, row = [], 0
    for slot, start, length in chunks:
        columns.append((slot, row, length, start + length))
        row += length
    # One dense row per field: the kernel reads each as a plain array (a transposed view would hand it every fourth
    # value).
    slots, q_starts, q_lens, kv_lens = torch.tensor(list(zip(*columns, strict=True)), dtype=torch.long).to(table.device)
    sequences = Sequences(
        slots=slots, q_starts=q_starts, q_lens=q_lens, kv_lens=kv_lens, max_q_len=max(c[2] for c in columns)
    )
    (_, start, length), *others = chunks
    lone_prompt = not others and start == 0 and length >= FLASH_MIN_ROWS and table.device.type == "cuda"
    return Layout(
        positions=positions, write_cells=write_cells, table=table, sequences=sequences,
        fresh=write_cells if lone_prompt else None,
    )  # fmt: skip


def decode_layout(
    *,
    table: Tensor,
    slots: Tensor,
    positions: Tensor,
    cells: Tensor,
    rows: Tensor,
    width: int = 1,
    window_table: Tensor | None = None,
    window_cells: Tensor | None = None,
    resident_table: Tensor | None = None,
    columns: Tensor | None = None,
) -> Layout:
    """Put each row's new cell in the pool's table (device only), its sliding-window cell in that space's table when
    there is one, and, with a resident window, its cell at its column of the window's table, which the full-attention
    layers then read. slots, positions, cells, columns: [B * width], `width` rows a slot, its consecutive positions in
    order (a step that verifies drafts); rows: [B] 0..B-1, made once by the caller."""
    table[slots, positions] = cells

    def sequences(ends: Tensor) -> Sequences:
        """Each slot's rows, seeing its columns up to each row's (`ends`)."""
        if width == 1:
            return Sequences(slots=slots, q_starts=rows, q_lens=torch.ones_like(rows), kv_lens=ends + 1, max_q_len=1)
        # the kernel indexes the sequences' columns densely: one copy each of the strided views
        return Sequences(
            slots=slots[::width].contiguous(),
            q_starts=rows * width,
            q_lens=torch.full_like(rows, width),
            kv_lens=ends[width - 1 :: width] + 1,
            max_q_len=width,
        )

    by_position = sequences(positions)
    window = None
    if window_table is not None and window_cells is not None:
        window_table[slots, positions] = window_cells
        window = Layout(positions=positions, write_cells=window_cells, table=window_table, sequences=by_position)
    if resident_table is None or columns is None:
        return Layout(positions=positions, write_cells=cells, table=table, sequences=by_position, window=window)
    resident_table[slots, columns] = cells
    return Layout(
        positions=positions, write_cells=cells, table=resident_table, sequences=sequences(columns), window=window,
        recorded=slots if width == 1 else None,
    )  # fmt: skip


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: Tensor) -> Tensor:
        return norms_and_gates.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, *, layer: int) -> None:
        super().__init__()
        self.config = config
        self.rule = config.attention_rule(layer)
        # q, k and v in one matrix (the loader stacks attn_q, attn_k, attn_v): one GEMM reads x once, and at decode
        # one launch replaces three, two of them too small to reach the GPU's bandwidth.
        self.wqkv: nn.Module = nn.Linear(config.dim, config.q_dim + 2 * config.kv_dim, bias=config.attention_bias)
        self.wo: nn.Module = nn.Linear(config.q_dim, config.dim, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else None

    def forward(self, x: Tensor, *, rope: Rope, cos: Tensor, sin: Tensor, cache: LayerCache, layout: Layout) -> Tensor:
        return self.attend(projection_pieces(self.wqkv, x), rope=rope, cos=cos, sin=sin, cache=cache, layout=layout)

    def attend(
        self, qkv: Sequence[Tensor], *, rope: Rope, cos: Tensor, sin: Tensor, cache: LayerCache, layout: Layout
    ) -> Tensor:
        """From the q/k/v projection of x on, as column pieces (`projection_pieces`): `Block` may form that projection
        with the norm before it."""
        c = self.config
        n = qkv[0].shape[0]
        q, k, v = split_columns(qkv, [c.q_dim, c.kv_dim, c.kv_dim])
        q = q.view(n, c.n_head, c.head_dim)  # [N, H, hd]
        k = k.view(n, c.n_head_kv, c.head_dim)  # [N, Hkv, hd]
        v = v.view(n, c.n_head_kv, c.head_dim)  # [N, Hkv, hd]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rotate_and_write(q=q, k=k, v=v, cos=cos, sin=sin, cells=layout.write_cells, cache=cache, rope=rope)
        if layout.recorded is not None and cache.queries is not None:
            cache.queries.index_copy_(0, layout.recorded, q)
        out = layout.attend(q, cache, c, self.rule)  # [N, H, hd]
        projected: Tensor = self.wo(out.reshape(n, c.q_dim))  # [N, D]
        return projected


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = GATES[config.activation]
        # ffn_gate stacked over ffn_up, for the same reason as Attention.wqkv.
        self.w_gate_up: nn.Module = nn.Linear(config.dim, 2 * config.ffn_dim, bias=False)
        self.w_down: nn.Module = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.w_gate_up(x))

    def normed(self, x: Tensor, residual: Tensor | None, norm: RMSNorm) -> tuple[Tensor, Tensor]:
        """(h, the feed-forward of norm(h)) with h = x + residual (x without one). On a GPU, for a decode step's row
        of a gate/up matrix of one quantised part (PackedLinear.activates), the activation happens as the gate/up
        product stores, and where the matrix takes the norm too (PackedLinear.takes_norm), the add and the norm in
        its load: one launch for all four."""
        w = self.w_gate_up
        if not (isinstance(w, PackedLinear) and w.activates(x)):
            h, gate_up = normed_projection(w, norm, x, residual)
            return h, self.down(joined(gate_up))
        if w.takes_norm(x):
            activated, h = w.normed_activation(x, residual, weight=norm.weight, eps=norm.eps, activate=self.gate)
        else:
            h, normed = norms_and_gates.add_rms_norm(x, residual, norm.weight, norm.eps)
            activated = w.activation(normed, self.gate)
        out: Tensor = self.w_down(activated)
        return h, out

    def down(self, gate_up: Tensor) -> Tensor:
        """From the gate/up projection of x on: `Block` may form that projection with the norm before it."""
        if isinstance(self.w_down, PackedLinear) and self.w_down.forms_gate(gate_up):
            # On a GPU, in a step of rows enough for the tensor-core kernel, the activation is formed in the down
            # projection's load of x: one launch a layer fewer.
            return self.w_down.gated(gate_up, self.gate)
        out: Tensor = self.w_down(norms_and_gates.activate(gate_up, self.gate))
        return out


def feed_forward(config: ModelConfig) -> nn.Module:
    """A dense feed-forward, or a mixture of experts (strata.stage_worker.experts) where the file has experts."""
    if not config.n_expert:
        return FeedForward(config)
    return MixtureOfExperts(config, activation=ACTIVATIONS[config.activation])


def projection_pieces(linear: nn.Module, x: Tensor) -> list[Tensor]:
    """linear(x) as column pieces: a matrix of parts of several types (PackedLinear.pieces) gives one a part, so that
    a caller splitting the columns copies none it need not (weights.linear.split_columns)."""
    return linear.pieces(x) if isinstance(linear, PackedLinear) else [linear(x)]


def normed_projection(
    linear: nn.Module, norm: RMSNorm, x: Tensor, residual: Tensor | None
) -> tuple[Tensor, list[Tensor]]:
    """(h, linear(norm(h)) as column pieces) with h = x + residual (x for a stage's first block). On a GPU, for a
    decode step's row of quantised matrices (PackedLinear.takes_norm), the add and the norm happen in the product's
    load of x: two launches a layer fewer."""
    if isinstance(linear, PackedLinear) and linear.takes_norm(x):
        pieces, h = linear.normed(x, residual, weight=norm.weight, eps=norm.eps)
        return h, pieces
    h, normed = norms_and_gates.add_rms_norm(x, residual, norm.weight, norm.eps)
    return h, projection_pieces(linear, normed)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, *, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = Attention(config, layer=layer)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn = feed_forward(config)
        self.attn_post_norm = RMSNorm(config.dim, config.norm_eps) if config.post_norms else None
        self.ffn_post_norm = RMSNorm(config.dim, config.norm_eps) if config.post_norms else None

    def forward(
        self,
        x: Tensor,
        residual: Tensor | None,
        *,
        rope: Rope,
        cos: Tensor,
        sin: Tensor,
        cache: LayerCache,
        layout: Layout,
    ) -> tuple[Tensor, Tensor]:
        """x [N, D] plus `residual` (the previous block's stream, None for the first) -> (this block's
        feed-forward output, its stream): the caller adds the two, or the next block does, so that the add fuses
        into the next block's norm."""
        h, qkv = normed_projection(self.attn.wqkv, self.attn_norm, x, residual)
        attended = self.attn.attend(qkv, rope=rope, cos=cos, sin=sin, cache=cache, layout=layout)
        if self.attn_post_norm is not None:
            attended = self.attn_post_norm(attended)
        if isinstance(self.ffn, FeedForward):
            h, fed = self.ffn.normed(attended, h, self.ffn_norm)
        else:
            h = h + attended
            fed = self.ffn(self.ffn_norm(h))
        if self.ffn_post_norm is not None:
            fed = self.ffn_post_norm(fed)
        return fed, h


class RopeFactors(nn.Module):
    """llama.cpp's rope_freqs.weight: one divisor per rotated pair's frequency (Llama 3.1's RoPE scaling)."""

    def __init__(self, pairs: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(pairs))


class RunBlock(Protocol):
    def __call__(
        self,
        block: nn.Module,
        x: Tensor,
        residual: Tensor | None,
        *,
        rope: Rope,
        cos: Tensor,
        sin: Tensor,
        cache: LayerCache,
        layout: Layout,
    ) -> tuple[Tensor, Tensor]: ...


def run_block(
    block: nn.Module,
    x: Tensor,
    residual: Tensor | None,
    *,
    rope: Rope,
    cos: Tensor,
    sin: Tensor,
    cache: LayerCache,
    layout: Layout,
) -> tuple[Tensor, Tensor]:
    out: tuple[Tensor, Tensor] = block(x, residual, rope=rope, cos=cos, sin=sin, cache=cache, layout=layout)
    return out


def run_wide_block(*args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
    """run_block for steps of several rows a slot (strata.stage_worker.wide_step). A function of its own because
    torch.compile keeps compiled code by code object: the wide steps' graphs (a few a width) stay apart from the
    one-row step's, and a one-row step never walks their guards."""
    return run_block(*args, **kwargs)


class StageModel(nn.Module):
    """Layers [layer_start, layer_end) of the model, plus the embedding when first and the head when last."""

    def __init__(self, config: ModelConfig, *, layer_start: int, layer_end: int) -> None:
        super().__init__()
        if not 0 <= layer_start < layer_end <= config.n_layer:
            raise ValueError(f"layer span [{layer_start}, {layer_end}) is not inside [0, {config.n_layer})")
        self.config = config
        self.layer_start = layer_start
        self.layer_end = layer_end
        self.is_first = layer_start == 0
        self.is_last = layer_end == config.n_layer
        self.token_embd: nn.Module | None = nn.Embedding(config.vocab_size, config.dim) if self.is_first else None
        self.layers = nn.ModuleList(Block(config, layer=il) for il in range(layer_start, layer_end))
        self.output_norm = RMSNorm(config.dim, config.norm_eps) if self.is_last else None
        self.output: nn.Module | None = nn.Linear(config.dim, config.vocab_size, bias=False) if self.is_last else None
        # Every stage rotates, so every stage holds the file's RoPE factors (loaded as rope_freqs.weight).
        self.rope_freqs = RopeFactors(config.rope_dim // 2) if config.rope_freqs else None

    def rope(self, *, device: torch.device) -> Rope:
        """The rotation this stage's layers apply, with the file's factors when it has them."""
        return Rope(
            self.config, device=device, freq_factors=None if self.rope_freqs is None else self.rope_freqs.weight
        )

    def embed(self, tokens: Tensor) -> Tensor:
        # tokens: [N] -> [N, D]
        if self.token_embd is None:
            raise RuntimeError("only the first stage holds the token embedding")
        out: Tensor = self.token_embd(tokens)
        if self.config.embedding_scale != 1.0:
            out = out * self.config.embedding_scale
        return out

    def forward(
        self, x: Tensor, *, rope: Rope, caches: list[LayerCache], layout: Layout, run: RunBlock | None = None
    ) -> Tensor:
        """`run` calls each block; the decoder passes a compiled one."""
        # x: [N, D] -> [N, D]
        sliding = [self.config.is_sliding(il) for il in range(self.layer_start, self.layer_end)]
        angles = {kind: rope.angles(layout.positions, sliding=kind) for kind in set(sliding)}  # once per rotation
        # Sliding layers address their own cells when the pool gives them a space of their own.
        layouts: dict[bool, Layout] = {False: layout, True: layout.window or layout}
        residual: Tensor | None = None
        for layer, cache, kind in zip(self.layers, caches, sliding, strict=True):
            cos, sin = angles[kind]
            x, residual = (run or run_block)(
                layer, x, residual, rope=rope, cos=cos, sin=sin, cache=cache, layout=layouts[kind]
            )
        return x if residual is None else x + residual

    def head(self, x: Tensor) -> Tensor:
        # x: [M, D] -> logits [M, vocab]
        if self.output_norm is None or self.output is None:
            raise RuntimeError("only the last stage holds the output head")
        logits: Tensor = self.output(self.output_norm(x))
        cap = self.config.final_softcap
        return cap * torch.tanh(logits / cap) if cap else logits
