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

from collections.abc import Sequence
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
    repetition_penalty: float = 1.0  # over `penalized`: a positive logit divided by it, a negative one multiplied
    penalized: tuple[int, ...] = ()  # the distinct tokens of the prompt and the generation so far

    @property
    def greedy_as_is(self) -> bool:
        """Greedy on the model's own logits: the batched argmax the decode body already took is the answer."""
        return (
            self.temperature <= 0.0
            and self.logprobs == 0
            and not self.allowed
            and not self.logit_bias
            and not self.penalized
        )


class NoTokenAllowedError(InvalidRequestError):
    """The mask allows no token of the vocabulary: nothing can be sampled."""


@dataclass(frozen=True)
class Sampled:
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]


def sample(logits: Tensor, *, params: Sampling, position: int) -> Sampled:
    """One row: `sample_rows` of a batch of one. logits: [vocab]."""
    return sample_rows(logits[None], params=[params], positions=[position])[0]


def sample_rows(logits: Tensor, *, params: Sequence[Sampling], positions: Sequence[int]) -> list[Sampled]:
    """A step's picks, all rows together: logits [B, vocab], one Sampling and one position per row.

    On a GPU a row sampled on its own costs a dozen small launches and a host sync, so 16 slots paid them 16 times a
    step. Here the rows' parameters travel to the device in a few small copies, every transform runs once over the
    batch, and the picks come back in one copy. The draw is by inverse CDF: one uniform number per row from a
    generator seeded by (seed, position), so a retried step picks the same tokens."""
    b, vocab = logits.shape
    device = logits.device
    raw = logits.float()
    nan, infinite = torch.isnan(raw).sum(-1), (raw == float("inf")).sum(-1)  # [B]; -inf only rules a token out
    logprobs = torch.log_softmax(raw, dim=-1)  # [B, vocab]; reported from the model's own distribution
    logits = _penalised(raw.clone(), params)
    biases = [(row, token, bias) for row, p in enumerate(params) for token, bias in p.logit_bias]
    if biases:
        rows, tokens, values = zip(*biases, strict=True)
        at = torch.tensor([rows, tokens], dtype=torch.long).to(device)
        logits.index_put_((at[0], at[1]), torch.tensor(values, dtype=torch.float32).to(device), accumulate=True)
    masked = [row for row, p in enumerate(params) if p.allowed]
    if masked:
        bits = np.stack([_allowed_bits(params[row].allowed, vocab=vocab) for row in masked])  # [R, vocab]
        at = torch.tensor(masked, dtype=torch.long).to(device)
        logits[at] = logits[at].masked_fill(~torch.from_numpy(bits).to(device), -1e30)
    sampled_rows = [p.temperature > 0.0 for p in params]
    token = torch.argmax(logits, dim=-1)  # [B]: the greedy rows' picks
    if any(sampled_rows):
        token = torch.where(torch.tensor(sampled_rows).to(device), _draw(logits, params, positions), token)
    picked = torch.stack((token.float(), logprobs.gather(1, token[:, None])[:, 0], nan.float(), infinite.float()))
    asked = max(p.logprobs for p in params)
    top_values, top_ids = torch.topk(logprobs, min(asked, vocab)) if asked > 0 else (None, None)
    tokens, chosen, nans, infs = picked.cpu().tolist()  # the one sync of a step without log-probabilities
    for row, position in enumerate(positions):
        if nans[row] or infs[row]:  # a clear error here rather than a NaN pick
            raise NonFiniteLogitsError(
                f"the logits for position {position} hold {int(nans[row])} NaN and {int(infs[row])} infinite "
                f"values of {vocab}: this stage's layers computed them"
            )
    tops: list[tuple[tuple[int, float], ...]] = [()] * b
    if top_values is not None and top_ids is not None:
        best, ids = top_values.cpu().tolist(), top_ids.cpu().tolist()
        tops = [tuple(zip(ids[r][: p.logprobs], best[r][: p.logprobs], strict=True)) for r, p in enumerate(params)]
    return [Sampled(token_id=int(tokens[row]), logprob=float(chosen[row]), top_logprobs=tops[row]) for row in range(b)]


def _penalised(logits: Tensor, params: Sequence[Sampling]) -> Tensor:
    """The repetition penalty, as HF and vLLM apply it: each row's penalized tokens' logits divided by the penalty
    where positive and multiplied where negative, before any bias."""
    entries = [
        (row, token, p.repetition_penalty)
        for row, p in enumerate(params)
        if p.repetition_penalty != 1.0
        for token in p.penalized
    ]
    if not entries:
        return logits
    rows, tokens, penalties = zip(*entries, strict=True)
    at = torch.tensor([rows, tokens], dtype=torch.long).to(logits.device)  # [2, E]
    penalty = torch.tensor(penalties).to(logits.device)
    picked = logits[at[0], at[1]]
    logits[at[0], at[1]] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def _draw(logits: Tensor, params: Sequence[Sampling], positions: Sequence[int]) -> Tensor:
    """[B] tokens drawn from each row's distribution at its temperature, cut by its top-k, top-p and min-p (rows
    that ask for greedy picks are drawn too, harmlessly, and then not used)."""
    vocab = logits.shape[1]
    device = logits.device
    sampled = [p.temperature > 0.0 for p in params]
    temperature = torch.tensor([p.temperature if on else 1.0 for p, on in zip(params, sampled, strict=True)])
    scaled = logits / temperature.to(device)[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        kth = torch.topk(scaled, max(top_k)).values  # [B, max k]
        k = torch.tensor(top_k, dtype=torch.long).to(device)
        threshold = torch.where(k > 0, kth.gather(1, (k - 1).clamp_min(0)[:, None])[:, 0], float("-inf"))
        scaled = scaled.masked_fill(scaled < threshold[:, None], float("-inf"))
    top_p = [p.top_p if 0.0 < p.top_p < 1.0 else 1.0 for p in params]
    if any(value < 1.0 for value in top_p):
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        mass = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays); rows without top-p keep
        # all, whatever the rounding of their sums.
        cut = torch.tensor(top_p).to(device)[:, None]
        drop = (mass.cumsum(-1) - mass >= cut) & (cut < 1.0)
        scaled = scaled.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    min_p = [p.min_p for p in params]
    if any(value > 0.0 for value in min_p):
        probabilities = torch.softmax(scaled, dim=-1)
        floor = torch.tensor(min_p).to(device)[:, None] * probabilities.amax(dim=-1, keepdim=True)
        scaled = scaled.masked_fill(probabilities < floor, float("-inf"))
    uniform = []
    for p, position in zip(params, positions, strict=True):
        generator = torch.Generator(device="cpu").manual_seed((p.seed * SEED_STRIDE + position) % (1 << 63))
        uniform.append(float(torch.rand((), generator=generator)))
    probabilities = torch.softmax(scaled, dim=-1)
    cdf = probabilities.cumsum(dim=-1)  # [B, vocab]
    target = torch.tensor(uniform).to(device)[:, None] * cdf[:, -1:]
    drawn = torch.searchsorted(cdf, target, right=True)[:, 0].clamp_max(vocab - 1)
    # A rounding at the top of the CDF may land past the last possible token: take the likeliest there instead.
    possible = probabilities.gather(1, drawn[:, None])[:, 0] > 0
    return torch.where(possible, drawn, torch.argmax(scaled, dim=-1))


def allowed_tokens(mask: bytes, *, vocab: int, device: torch.device) -> Tensor:
    """The bitmask as [vocab] bools; tokens past its end are not allowed. Refuses a mask that allows nothing."""
    return torch.from_numpy(_allowed_bits(mask, vocab=vocab)).to(device)


def _allowed_bits(mask: bytes, *, vocab: int) -> np.ndarray:
    # One C call (numpy's unpackbits) rather than a chain of small torch ops: this runs per slot per step.
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:vocab]  # [<= vocab]
    if not bits.any():
        raise NoTokenAllowedError(f"the allowed-token mask allows none of the {vocab} tokens")
    allowed = np.zeros(vocab, dtype=np.bool_)
    allowed[: bits.shape[0]] = bits.astype(np.bool_)
    return allowed
