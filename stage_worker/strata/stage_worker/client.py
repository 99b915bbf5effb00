"""Driving a pipeline from the coordinator's side: claim it, then run requests with continuous batching.

Every step carries one chunk per active slot: a slice of the prompt (long prompts prefill `prefill_chunk` tokens
at a time) or the last sampled token. A slot that finishes is reset and handed to the next waiting request in the
same loop, so short and long requests share steps. The gateway's coordinator drives the pipeline the same way;
tests and benchmarks use this module directly, and wait for the stages to load with `wait_loaded` (from
strata.stage_loading, which `strata serve` shares), which ends on a stage's failure or a deadline with its message.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from strata.rpc.v1 import stage_pb2
from strata.stage_loading import StageLoadError, wait_loaded
from strata.stage_worker.next_stage import NextStage
from strata.stage_worker.wire import tensor_from_proto

__all__ = ["Completion", "Pipeline", "Request", "StageLoadError", "wait_loaded"]


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: stage_pb2.SamplingParams = field(default_factory=stage_pb2.SamplingParams)
    prompt_logits: bool = False  # return the logits of every prompt position


@dataclass
class Completion:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logits: list[torch.Tensor] = field(default_factory=list)  # one [chunk, vocab] tensor per prefill chunk


@dataclass
class _Active:
    index: int
    request: Request
    fed: int = 0  # positions already sent


class Pipeline:
    def __init__(
        self, target: str, *, fence: stage_pb2.Fence, plan_generation: int = 0, step_timeout_s: float = 120.0
    ) -> None:
        self.fence = fence
        self.plan_generation = plan_generation
        self.link = NextStage(target, step_timeout_s=step_timeout_s)
        self._step_id = 0

    def claim(self) -> None:
        self.link.claim(stage_pb2.ClaimRequest(fence=self.fence, plan_generation=self.plan_generation))

    def reset(self, slot: int) -> None:
        self.link.reset_slot(stage_pb2.ResetSlotRequest(fence=self.fence, slot=slot))

    def step(self, chunks: list[stage_pb2.SlotChunk]) -> stage_pb2.ForwardReply:
        self._step_id += 1
        request = stage_pb2.ForwardRequest(
            fence=self.fence, plan_generation=self.plan_generation, step_id=self._step_id, chunks=chunks
        )
        return self.link.forward(request)

    def generate(self, requests: list[Request], *, slots: int, prefill_chunk: int = 64) -> list[Completion]:
        if any(request.max_tokens < 1 for request in requests):
            raise ValueError("every request samples at least one token (max_tokens >= 1)")
        results = [Completion() for _ in requests]
        waiting = deque(enumerate(requests))
        active: dict[int, _Active] = {}
        while waiting or active:
            for slot in range(slots):
                if slot not in active and waiting:
                    index, request = waiting.popleft()
                    active[slot] = _Active(index=index, request=request)
            chunks = [self._chunk(slot, state, results[state.index], prefill_chunk) for slot, state in active.items()]
            reply = self.step(chunks)
            for logits in reply.logits:
                results[active[logits.slot].index].prompt_logits.append(tensor_from_proto(logits.logits))
            for token in reply.tokens:
                done = results[active[token.slot].index]
                done.tokens.append(token.token_id)
                done.logprobs.append(token.logprob)
                done.top_logprobs.append([(t.token_id, t.logprob) for t in token.top_logprobs])
            for chunk in chunks:
                state = active[chunk.slot]
                state.fed += chunk.length
                if len(results[state.index].tokens) >= state.request.max_tokens:
                    self.reset(chunk.slot)
                    del active[chunk.slot]
        return results

    @staticmethod
    def _chunk(slot: int, state: _Active, done: Completion, prefill_chunk: int) -> stage_pb2.SlotChunk:
        prompt = state.request.prompt
        if state.fed < len(prompt):
            ids = prompt[state.fed : state.fed + prefill_chunk]
            last = state.fed + len(ids) == len(prompt)
            return stage_pb2.SlotChunk(
                slot=slot,
                start_position=state.fed,
                length=len(ids),
                token_ids=ids,
                sample=last,
                sampling=state.request.sampling,
                return_logits=state.request.prompt_logits,
            )
        return stage_pb2.SlotChunk(
            slot=slot,
            start_position=state.fed,
            length=1,
            token_ids=[done.tokens[-1]],
            sample=True,
            sampling=state.request.sampling,
        )
