"""Choosing the next token from the last stage's logits: greedy, temperature, top-k, top-p, seeded.

The random draw for a slot is seeded from (seed, position), not from a generator that advances with each call: a
step that is retried after a failure draws the same token again, and slots never share random state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # 0 or >= 1: off
    top_k: int = 0  # 0: off
    seed: int = 0
    logprobs: int = 0  # alternatives to return per token


@dataclass(frozen=True)
class Sampled:
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]


def sample(logits: Tensor, *, params: Sampling, position: int) -> Sampled:
    # logits: [vocab]
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)  # [vocab]; reported from the model's own distribution
    if params.temperature <= 0.0:
        token = int(torch.argmax(logits))
    else:
        scaled = logits / params.temperature
        if 0 < params.top_k < scaled.shape[0]:
            kth = torch.topk(scaled, params.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if 0.0 < params.top_p < 1.0:
            sorted_logits, order = torch.sort(scaled, descending=True)
            cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= params.top_p
            scaled = scaled.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        generator = torch.Generator(device="cpu").manual_seed((params.seed * SEED_STRIDE + position) % (1 << 63))
        probabilities = torch.softmax(scaled, dim=-1).cpu()
        token = int(torch.multinomial(probabilities, 1, generator=generator))
    top: tuple[tuple[int, float], ...] = ()
    if params.logprobs > 0:
        values, indices = torch.topk(logprobs, min(params.logprobs, logprobs.shape[0]))
        top = tuple(zip(indices.tolist(), values.tolist(), strict=True))
    return Sampled(token_id=token, logprob=float(logprobs[token]), top_logprobs=top)
