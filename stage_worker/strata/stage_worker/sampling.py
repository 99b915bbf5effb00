"""Choosing the next token from the last stage's logits: biased, masked, greedy or by temperature, top-k, top-p,
min-p, seeded.

A logit bias (OpenAI's logit_bias, with the coordinator's presence and frequency penalties folded in) is added to
the logits first. Then a mask of allowed tokens (a grammar's, computed by the coordinator, which holds the grammar's
state) removes every other token, so greedy and sampled picks alike stay inside it. The reported log-probabilities
remain the model's own. The random draw for a slot is seeded from (seed, position), not from a
generator that advances with each call: a step that is retried after a failure draws the same token again, and slots
never share random state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from strata.stage_worker.errors import InvalidRequestError, NonFiniteLogitsError
from torch import Tensor

SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # 0 or >= 1: off
    top_k: int = 0  # 0: off
    seed: int = 0
    logprobs: int = 0  # alternatives to return per token
    allowed: bytes = b""  # bitmask of the tokens that may be chosen (bit i%8 of byte i/8); empty: any
    min_p: float = 0.0  # 0: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)

    @property
    def greedy_as_is(self) -> bool:
        """Greedy on the model's own logits: the batched argmax the decode body already took is the answer."""
        return self.temperature <= 0.0 and self.logprobs == 0 and not self.allowed and not self.logit_bias


class NoTokenAllowedError(InvalidRequestError):
    """The mask allows no token of the vocabulary: nothing can be sampled."""


@dataclass(frozen=True)
class Sampled:
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]


def sample(logits: Tensor, *, params: Sampling, position: int) -> Sampled:
    # logits: [vocab]
    logits = logits.float()
    nan, infinite = torch.isnan(logits), logits == float("inf")  # -inf only rules a token out
    if bool((nan | infinite).any()):  # a clear error here rather than torch.multinomial's, or a NaN greedy pick
        raise NonFiniteLogitsError(
            f"the logits for position {position} hold {int(nan.sum())} NaN and {int(infinite.sum())} infinite "
            f"values of {logits.shape[0]}: this stage's layers computed them"
        )
    logprobs = torch.log_softmax(logits, dim=-1)  # [vocab]; reported from the model's own distribution
    if params.logit_bias:
        ids = torch.tensor([i for i, _ in params.logit_bias], dtype=torch.long, device=logits.device)
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=logits.dtype, device=logits.device)
        logits = logits.index_add(0, ids, bias)
    if params.allowed:
        logits = logits.masked_fill(~allowed_tokens(params.allowed, vocab=logits.shape[0], device=logits.device), -1e30)
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
        if params.min_p > 0.0:
            probabilities = torch.softmax(scaled, dim=-1)
            scaled = scaled.masked_fill(probabilities < params.min_p * probabilities.max(), float("-inf"))
        generator = torch.Generator(device="cpu").manual_seed((params.seed * SEED_STRIDE + position) % (1 << 63))
        probabilities = torch.softmax(scaled, dim=-1).cpu()
        token = int(torch.multinomial(probabilities, 1, generator=generator))
    top: tuple[tuple[int, float], ...] = ()
    if params.logprobs > 0:
        values, indices = torch.topk(logprobs, min(params.logprobs, logprobs.shape[0]))
        top = tuple(zip(indices.tolist(), values.tolist(), strict=True))
    return Sampled(token_id=token, logprob=float(logprobs[token]), top_logprobs=top)


def allowed_tokens(mask: bytes, *, vocab: int, device: torch.device) -> Tensor:
    """The bitmask as [vocab] bools; tokens past its end are not allowed. Refuses a mask that allows nothing."""
    # One C call (numpy's unpackbits) rather than a chain of small torch ops: this runs per slot per step.
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:vocab]  # [<= vocab]
    if not bits.any():
        raise NoTokenAllowedError(f"the allowed-token mask allows none of the {vocab} tokens")
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[: bits.shape[0]] = torch.from_numpy(bits.astype(np.bool_))
    return allowed.to(device)
