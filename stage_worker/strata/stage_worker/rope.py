"""Rotary position embedding as llama.cpp applies it for each architecture, with the RoPE scaling the file states.

Each rotated pair of a head's features turns by position x frequency. The frequencies are base^(-2i/d) for the
layer's base (Gemma 3's sliding layers have a base of their own), then, where the file asks and the layer is one it
applies to, divided by llama.cpp's rope_freqs factors (Llama 3.1) and by the linear scaling factor: the same angles
as HF's "llama3" and "linear" rope types (strata.gguf.rope_scaling says which scalings a file may ask for).
Which features pair up is the architecture's RoPE style: adjacent pairs where llama.cpp's converter permuted q/k
rows ("normal"), the two halves where it kept HF's order ("neox").
"""

from __future__ import annotations

import torch
from strata.gguf.architectures import RopeStyle
from strata.stage_worker.model_config import ModelConfig
from torch import Tensor


class Rope:
    """Rotation of the first `rope_dim` features of each head, computed in f32. `freq_factors`: [rope_dim / 2], the
    file's rope_freqs.weight when the config says it has one."""

    def __init__(self, config: ModelConfig, *, device: torch.device, freq_factors: Tensor | None = None) -> None:
        if config.rope_freqs != (freq_factors is not None):
            raise ValueError("rope_freqs factors are given exactly when the config says the file has them")
        exponents = torch.arange(0, config.rope_dim, 2, dtype=torch.float32, device=device) / config.rope_dim
        divisor = torch.full_like(exponents, config.rope_scale)  # [rope_dim / 2]
        if freq_factors is not None:
            divisor = divisor * freq_factors.to(device=device, dtype=torch.float32)
        self.inv_freq = 1.0 / (config.rope_theta**exponents) / divisor  # [rope_dim / 2]
        sliding_theta = config.sliding_rope_theta or config.rope_theta
        sliding_divisor = divisor if config.sliding_rope_scaled else torch.ones_like(divisor)
        self.sliding_inv_freq = 1.0 / (sliding_theta**exponents) / sliding_divisor  # [rope_dim / 2]
        self.style = config.rope_style
        self.rope_dim = config.rope_dim

    def angles(self, positions: Tensor, *, sliding: bool = False) -> tuple[Tensor, Tensor]:
        inv_freq = self.sliding_inv_freq if sliding else self.inv_freq
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [N, rope_dim / 2]
        return freqs.cos()[:, None, :], freqs.sin()[:, None, :]  # [N, 1, rope_dim / 2]

    def apply(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        # x: [N, H, head_dim]
        # Real arithmetic only: torch.compile cannot fuse complex numbers, and breaks the compiled block around them.
        rot, rest = x[..., : self.rope_dim].float(), x[..., self.rope_dim :]
        if self.style is RopeStyle.NORM:
            pairs = rot.reshape(*rot.shape[:-1], -1, 2)  # [N, H, rope_dim / 2, 2]: adjacent pairs (a, b)
            a, b = pairs[..., 0], pairs[..., 1]
            rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
        else:
            a, b = rot.chunk(2, dim=-1)
            rotated = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
        if rest.shape[-1] == 0:
            return rotated.to(x.dtype)
        return torch.cat((rotated.to(x.dtype), rest), dim=-1)
