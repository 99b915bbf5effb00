"""Llama 3.1's RoPE scaling as llama.cpp's converter writes it: HF's "llama3" parameters folded into one divisor per
rotated pair's frequency, stored as rope_freqs.weight (convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors).

Frequencies whose wavelength is shorter than original_context / high_freq_factor keep theirs (divisor 1), those
longer than original_context / low_freq_factor are divided by `factor`, and the ones between blend the two.
"""

from __future__ import annotations

import math


def llama3_rope_factors(
    *,
    rope_dim: int,
    base: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_context: int,
) -> tuple[float, ...]:
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor
    factors = []
    for i in range(0, rope_dim, 2):
        wavelen = 2 * math.pi * base ** (i / rope_dim)
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return tuple(factors)
