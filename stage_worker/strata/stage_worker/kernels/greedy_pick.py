"""A decode step's greedy pick, each row's argmax token and its log-probability: one function, two bodies.

`greedy_pick` is what the decoder calls. On a CUDA device it runs the Triton kernel (strata.stage_worker.kernels.
greedy_pick_triton), the vocabulary split across programs; anywhere else, and as the kernel's test oracle, it runs
`reference`. Registered as a torch custom op so that a CUDA graph replays it inside the step.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor


def reference(logits: Tensor) -> Tensor:
    """logits [B, vocab] f32 -> [2, B] f32: each row's argmax token and its log-probability."""
    token = torch.argmax(logits, dim=-1)  # [B]
    logprob = logits.gather(1, token[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)  # [B]
    return torch.stack((token.float(), logprob))


@torch.library.custom_op("strata::greedy_pick", mutates_args=())
def _greedy_pick_op(logits: Tensor) -> Tensor:
    from strata.stage_worker.kernels.greedy_pick_triton import greedy_pick

    # Triton launches on the current device's stream, whatever the tensors say (under its interpreter, on the CPU).
    with torch.cuda.device(logits.device) if logits.device.type == "cuda" else nullcontext():
        return greedy_pick(logits)


@_greedy_pick_op.register_fake
def _(logits: Tensor) -> Tensor:
    return logits.new_empty((2, logits.shape[0]), dtype=torch.float32)


def kernel(logits: Tensor) -> Tensor:
    """The Triton kernel on any device (on the CPU under Triton's interpreter: the tests' way in)."""
    out: Tensor = _greedy_pick_op(logits)
    return out


def greedy_pick(logits: Tensor) -> Tensor:
    """logits [B, vocab] f32 -> [2, B] f32: `kernel` on CUDA, `reference` elsewhere."""
    return kernel(logits) if logits.device.type == "cuda" else reference(logits)
