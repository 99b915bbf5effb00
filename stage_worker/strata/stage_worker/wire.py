"""Converting between the protobuf messages and the engine's tensors and chunks; no logic beyond the encoding."""

from __future__ import annotations

import dataclasses

import torch
from strata.rpc.v1 import stage_pb2
from strata.stage_worker.engine import Chunk, StepResult
from strata.stage_worker.errors import InvalidRequestError
from strata.stage_worker.prefix_cache import PrefixCacheStats
from strata.stage_worker.sampling import Sampling
from torch import Tensor

WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def tensor_to_proto(tensor: Tensor) -> stage_pb2.Tensor:
    name = str(tensor.dtype).removeprefix("torch.")
    raw = tensor.detach().contiguous().cpu()
    # numpy has no bfloat16; the bytes are the same through a 16-bit integer view.
    data = (raw.view(torch.int16) if raw.dtype == torch.bfloat16 else raw).numpy().tobytes()
    return stage_pb2.Tensor(dtype=name, shape=list(raw.shape), data=data)


def tensor_from_proto(message: stage_pb2.Tensor) -> Tensor:
    if message.dtype not in WIRE_DTYPES:
        raise InvalidRequestError(f"tensor dtype {message.dtype!r} is not one of {', '.join(WIRE_DTYPES)}")
    dtype = WIRE_DTYPES[message.dtype]
    shape = tuple(message.shape)
    elements = 1
    for d in shape:
        elements *= d
    expected = elements * dtype.itemsize
    if len(message.data) != expected:
        raise InvalidRequestError(
            f"tensor of shape {shape} needs {expected} bytes of {message.dtype}, got {len(message.data)}"
        )
    if not message.data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(message.data), dtype=dtype).reshape(shape)


def chunk_from_proto(message: stage_pb2.SlotChunk) -> Chunk:
    s = message.sampling
    return Chunk(
        slot=message.slot,
        start_position=message.start_position,
        length=message.length,
        token_ids=tuple(message.token_ids),
        sample=message.sample,
        sampling=Sampling(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=s.seed,
            logprobs=s.logprobs,
            allowed=message.allowed_tokens,
            min_p=s.min_p,
            logit_bias=tuple(sorted(s.logit_bias.items())),
            repetition_penalty=s.repetition_penalty or 1.0,
            penalized=tuple(s.penalized),
        ),
        return_logits=message.return_logits,
        drafted=message.drafted,
        draft_allowed=tuple(message.draft_allowed_tokens),
    )


def reply_from_result(step_id: int, result: StepResult) -> stage_pb2.ForwardReply:
    """The step's picks: one per sampled chunk, and a drafted chunk's run in order (each a token of its slot)."""
    picked = [*result.tokens.items(), *((slot, s) for slot, run in result.runs.items() for s in run)]
    tokens = [
        stage_pb2.SampledToken(
            slot=slot,
            token_id=sampled.token_id,
            logprob=sampled.logprob,
            top_logprobs=[stage_pb2.TokenLogprob(token_id=t, logprob=p) for t, p in sampled.top_logprobs],
        )
        for slot, sampled in picked
    ]
    logits = [stage_pb2.ChunkLogits(slot=slot, logits=tensor_to_proto(v)) for slot, v in result.logits.items()]
    return stage_pb2.ForwardReply(step_id=step_id, tokens=tokens, logits=logits)


def stats_to_proto(stats: PrefixCacheStats) -> stage_pb2.PrefixCacheStats:
    return stage_pb2.PrefixCacheStats(**dataclasses.asdict(stats))


def summed_stats(*parts: stage_pb2.PrefixCacheStats) -> stage_pb2.PrefixCacheStats:
    """One figure for the pipeline: each stage adds its own to what the stages after it reported."""
    names = [f.name for f in dataclasses.fields(PrefixCacheStats)]
    return stage_pb2.PrefixCacheStats(**{name: sum(getattr(part, name) for part in parts) for name in names})
