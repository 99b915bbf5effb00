"""The serving object: OpenAI requests in, admitted generations on the pipelines, OpenAI responses out.

Routes hand it validated protocol models and get back a response model or an async iterator of SSE lines; every
failure is a GatewayError. Admission happens before a response starts, so a 429 or 503 is a real HTTP status even
for streaming requests. Whoever consumes a generation cancels it when it stops early (stop string, client gone),
which resets its slot and frees its lane.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from functools import cached_property

from pydantic import BaseModel
from strata.demand import Demand
from strata.gateway import chat_tools
from strata.gateway import protocol as p
from strata.gateway.admission import Admission
from strata.gateway.chat_template import ChatTemplate
from strata.gateway.cold_start import ColdStart
from strata.gateway.errors import (
    ContextLengthExceededError,
    GatewayError,
    InvalidRequestError,
    ModelNotFoundError,
    NotReadyError,
)
from strata.gateway.generation import Finished, Sampling, Token
from strata.gateway.grammar import Constraint, Grammars
from strata.gateway.logprobs import chat_logprobs, completion_logprobs
from strata.gateway.metrics import GatewayMetrics
from strata.gateway.model_ids import canonical_model_id, same_model
from strata.gateway.pipelines import Pipelines
from strata.gateway.runs import Piece, Run, usage_of
from strata.gateway.streams import merged
from strata.gateway.text import TextAssembler
from strata.gateway.tokenizer import GGUFTokenizer
from strata.gateway.tools import ToolFormat


def sse(payload: BaseModel | dict[str, object] | str) -> str:
    if isinstance(payload, str):
        return f"data: {payload}\n\n"
    data = payload.model_dump_json(exclude_none=False) if isinstance(payload, BaseModel) else _json(payload)
    return f"data: {data}\n\n"


def _json(payload: dict[str, object]) -> str:
    import json

    return json.dumps(payload, ensure_ascii=False)


class Serving:
    def __init__(
        self,
        *,
        model_name: str,
        tokenizer: GGUFTokenizer,
        template: ChatTemplate | None,
        pipelines: Pipelines,
        admission: Admission,
        metrics: GatewayMetrics,
        context: int,
        cold_start: ColdStart | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`cold_start`: hold a request while no pipeline serves (a deployment that scales from zero)."""
        self.model_name = canonical_model_id(model_name)
        self.tokenizer = tokenizer
        self.template = template
        self.pipelines = pipelines
        self.admission = admission
        self.metrics = metrics
        self.context = context
        self.cold_start = cold_start
        self.grammars = Grammars(tokenizer)
        self.created = int(time.time())
        self._clock = clock

    @property
    def accepting(self) -> bool:
        """Ready for traffic: a pipeline serves, or this coordinator holds requests while one comes up."""
        return self.pipelines.ready or (self.cold_start is not None and self.pipelines.coordinating)

    def demand(self) -> Demand:
        """What this gateway reports to the operator's autoscaler (strata.demand)."""
        return Demand(
            lanes=self.pipelines.capacity,
            busy=max(self.admission.busy, 0),
            queue=self.admission.waiting,
            held=self.cold_start.held if self.cold_start is not None else 0,
        )

    # Models.

    def models(self) -> p.ModelList:
        return p.ModelList(data=[p.ModelCard(id=self.model_name, created=self.created, context_length=self.context)])

    def model(self, model_id: str) -> p.ModelCard:
        self._check_model(model_id)
        return self.models().data[0]

    def _check_model(self, requested: str) -> None:
        if not same_model(requested, self.model_name):
            raise ModelNotFoundError(
                f"the model {requested!r} does not exist here; this gateway serves {self.model_name!r}", param="model"
            )

    # Chat completions.

    async def chat(self, request: p.ChatCompletionRequest) -> p.ChatCompletion | AsyncIterator[str]:
        self._check_common(request)
        if self.template is None:
            raise InvalidRequestError("the model has no chat template; use /v1/completions", param="messages")
        use = chat_tools.plan(request, self.tool_format)
        grammar = use.grammar(self.grammars) if use is not None else self.grammars.response(request.response_format)
        messages = chat_tools.template_messages(request, use, self.tool_format)
        rendered = self.template.render(messages, tools=use.template_tools() if use is not None else None)
        prompt = self.tokenizer.encode(rendered, add_special=False)
        top = request.top_logprobs or 0 if request.logprobs else 0
        constraints = [self.grammars.start(grammar) if grammar is not None else None for _ in range(request.n)]
        runs = await self._start(request, prompt, param="messages", logprobs=top, constraints=constraints)
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if request.stream:
            return self._chat_stream(request, runs, use, completion_id=completion_id, created=created)
        choices = []
        for index, (text, tokens, reason) in enumerate(await self._collect(runs)):
            content: str | None = text
            calls: list[p.ToolCall] = []
            if use is not None:
                content, calls = use.reply(plain=text, raw=self._with_specials(tokens))
            choice = p.ChatChoice(
                index=index,
                message=p.AssistantMessage(content=content, tool_calls=calls or None),
                finish_reason="tool_calls" if calls else reason,
                logprobs=chat_logprobs(self.tokenizer, tokens) if request.logprobs else None,
            )
            choices.append(choice)
        return p.ChatCompletion(
            id=completion_id, created=created, model=self.model_name, choices=choices, usage=usage_of(runs)
        )

    async def _chat_stream(
        self,
        request: p.ChatCompletionRequest,
        runs: list[Run],
        use: chat_tools.ToolUse | None,
        *,
        completion_id: str,
        created: int,
    ) -> AsyncIterator[str]:
        """Text as it settles, the choices side by side; with tools in play a choice is held back until it ends,
        since any of it may turn out to be a call, and then sent as content or as tool-call deltas."""

        def chunk(index: int, delta: p.Delta, **fields: object) -> str:
            choice = p.ChatChunkChoice(index=index, delta=delta, **fields)  # type: ignore[arg-type]
            return sse(
                p.ChatCompletionChunk(id=completion_id, created=created, model=self.model_name, choices=[choice])
            )

        async def choice(index: int, run: Run) -> AsyncIterator[str]:
            held: list[Token] = []
            held_text: list[str] = []
            async for piece in self._pieces(run):
                logprobs = chat_logprobs(self.tokenizer, piece.tokens) if request.logprobs and piece.tokens else None
                if use is not None:
                    held.extend(piece.tokens)
                    held_text.append(piece.text)
                elif piece.text or logprobs:
                    yield chunk(index, p.Delta(content=piece.text), logprobs=logprobs)
                if not piece.finish_reason:
                    continue
                reason = piece.finish_reason
                if use is not None:
                    content, calls = use.reply(plain="".join(held_text), raw=self._with_specials(held))
                    logprobs = chat_logprobs(self.tokenizer, held) if request.logprobs and held else None
                    if content or logprobs:
                        yield chunk(index, p.Delta(content=content or ""), logprobs=logprobs)
                    for number, call in enumerate(calls):
                        delta = p.ToolCallDelta(
                            index=number,
                            id=call.id,
                            type="function",
                            function=p.FunctionCallDelta(name=call.function.name, arguments=call.function.arguments),
                        )
                        yield chunk(index, p.Delta(tool_calls=[delta]))
                    reason = "tool_calls" if calls else reason
                yield chunk(index, p.Delta(), finish_reason=reason)

        try:
            for index in range(len(runs)):
                yield chunk(index, p.Delta(role="assistant", content=""))
            async for line in merged([choice(index, run) for index, run in enumerate(runs)]):
                yield line
            if request.stream_options and request.stream_options.include_usage:
                yield sse(
                    p.ChatCompletionChunk(
                        id=completion_id, created=created, model=self.model_name, choices=[], usage=usage_of(runs)
                    )
                )
        except GatewayError as error:
            yield sse(error.body())
        yield sse("[DONE]")

    def _with_specials(self, tokens: list[Token]) -> str:
        """The reply as text with its special tokens written out (a Mistral call starts with one), ending tokens
        left out."""
        ids = [t.token_id for t in tokens if t.token_id not in self.tokenizer.stop_ids]
        return self.tokenizer.decode(ids, skip_special=False)

    @cached_property
    def tool_format(self) -> ToolFormat:
        return chat_tools.template_format(self.template)

    # Completions.

    async def complete(self, request: p.CompletionRequest) -> p.Completion | AsyncIterator[str]:
        self._check_common(request)
        prompt = self._completion_prompt(request.prompt)
        runs = await self._start(request, prompt, param="prompt", logprobs=request.logprobs or 0,
                                 constraints=[None] * request.n)  # fmt: skip
        completion_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if request.stream:
            return self._completion_stream(request, runs, completion_id=completion_id, created=created)
        choices = [
            p.CompletionChoice(
                index=index,
                text=text,
                finish_reason=reason,
                logprobs=completion_logprobs(self.tokenizer, tokens, run=run) if request.logprobs is not None else None,
            )
            for index, (run, (text, tokens, reason)) in enumerate(zip(runs, await self._collect(runs), strict=True))
        ]
        return p.Completion(
            id=completion_id, created=created, model=self.model_name, choices=choices, usage=usage_of(runs)
        )

    async def _completion_stream(
        self, request: p.CompletionRequest, runs: list[Run], *, completion_id: str, created: int
    ) -> AsyncIterator[str]:
        def chunk(**fields: object) -> str:
            choice = p.CompletionChoice(**fields)  # type: ignore[arg-type]
            return sse(p.Completion(id=completion_id, created=created, model=self.model_name, choices=[choice]))

        async def choice(index: int, run: Run) -> AsyncIterator[str]:
            async for piece in self._pieces(run):
                logprobs = (
                    completion_logprobs(self.tokenizer, piece.tokens, run=run) if request.logprobs is not None else None
                )
                if piece.text or piece.tokens:
                    yield chunk(index=index, text=piece.text, logprobs=logprobs)
                if piece.finish_reason:
                    yield chunk(index=index, text="", finish_reason=piece.finish_reason)

        try:
            async for line in merged([choice(index, run) for index, run in enumerate(runs)]):
                yield line
            if request.stream_options and request.stream_options.include_usage:
                yield sse(
                    p.Completion(
                        id=completion_id, created=created, model=self.model_name, choices=[], usage=usage_of(runs)
                    )
                )
        except GatewayError as error:
            yield sse(error.body())
        yield sse("[DONE]")

    def _completion_prompt(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if prompt and all(isinstance(x, int) for x in prompt):
            ids = [int(x) for x in prompt]  # type: ignore[arg-type]
            bad = [i for i in ids if not 0 <= i < self.tokenizer.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"token ids {bad[:5]} are outside the vocabulary of {self.tokenizer.vocab_size}", param="prompt"
                )
            return ids
        if len(prompt) == 1 and isinstance(prompt[0], str | list):
            return self._completion_prompt(prompt[0])
        raise InvalidRequestError(
            "give one prompt (a string or a list of token ids); batches are not supported", param="prompt"
        )

    # Shared.

    def _check_common(self, request: p.ChatCompletionRequest | p.CompletionRequest) -> None:
        self._check_model(request.model)

    async def _start(
        self,
        request: p.ChatCompletionRequest | p.CompletionRequest,
        prompt: list[int],
        *,
        param: str,
        logprobs: int,
        constraints: Sequence[Constraint | None],
    ) -> list[Run]:
        """One run per choice (n of them, `constraints` holds each one's grammar), on lanes taken all at once."""
        n = len(constraints)
        if self.pipelines.lanes and n > self.pipelines.lanes:  # with no pipeline driven the lanes are not known
            raise InvalidRequestError(
                f"n={n} asks for more choices than the {self.pipelines.lanes} lanes that run at once", param="n"
            )
        if not prompt:
            raise InvalidRequestError("the prompt is empty", param=param)
        if len(prompt) >= self.context:
            raise ContextLengthExceededError(
                f"the prompt is {len(prompt)} tokens; this model's context is {self.context} tokens, and at least one "
                "must be left to generate",
                param=param,
            )
        remaining = self.context - len(prompt)
        limit = request.token_limit()
        max_tokens = min(limit, remaining) if limit is not None else remaining
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        biases = request.biases()
        outside = sorted(t for t in biases if t >= self.tokenizer.vocab_size)
        if outside:
            raise InvalidRequestError(
                f"logit_bias names token ids {outside[:5]} outside the vocabulary of {self.tokenizer.vocab_size}",
                param="logit_bias",
            )
        sampling = Sampling(
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            min_p=request.min_p,
            seed=seed,
            logprobs=logprobs,
            logit_bias=biases,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
        )
        if not self.pipelines.ready and self.cold_start is not None and self.pipelines.coordinating:
            await self.cold_start.hold(self.pipelines)
        if not self.pipelines.ready:
            raise NotReadyError(f"no pipeline serves: {self.pipelines.not_ready_reason}", retry_after_s=1)
        if n > self.admission.lanes:  # a pipeline is down: fewer lanes serve now than the deployment has
            raise NotReadyError(f"n={n} needs {n} lanes at once and {self.admission.lanes} serve now", retry_after_s=1)
        lanes = await self.admission.acquire_lanes(n)
        runs: list[Run] = []
        try:
            for index, (lane, constraint) in enumerate(zip(lanes, constraints, strict=True)):
                generation = self.pipelines.submit(
                    prompt=tuple(prompt),
                    max_tokens=max_tokens,
                    # Each choice draws its own tokens: seeds one apart, so a seeded request repeats whole.
                    sampling=dataclasses.replace(sampling, seed=(seed + index) % (1 << 63)),
                    stop_ids=self.tokenizer.stop_ids,
                    on_freed=functools.partial(self.admission.release, lane),
                    constraint=constraint,
                    cache_salt=request.cache_salt or "",
                )
                runs.append(Run(generation=generation, prompt_tokens=len(prompt), stops=request.stop_strings()))
        except BaseException:
            for run in runs:  # submitted: the driver frees their lanes once their slots are reset
                self.pipelines.cancel(run.generation)
            for lane in lanes[len(runs) :]:
                self.admission.release(lane)
            raise
        self.metrics.prompt_tokens.inc(len(prompt))
        return runs

    async def _collect(self, runs: list[Run]) -> list[tuple[str, list[Token], str]]:
        """(text, tokens, finish reason) of each run, run side by side; a failure in one cancels the others."""

        async def one(run: Run) -> tuple[str, list[Token], str]:
            text, tokens, reason = [], [], "stop"
            async for piece in self._pieces(run):
                text.append(piece.text)
                tokens.extend(piece.tokens)
                reason = piece.finish_reason or reason
            return "".join(text), tokens, reason

        if len(runs) == 1:
            return [await one(runs[0])]
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(run)) for run in runs]
        except BaseExceptionGroup as failed:  # the first GatewayError is what the client hears
            raise failed.exceptions[0] from None
        return [task.result() for task in tasks]

    async def _pieces(self, run: Run) -> AsyncIterator[Piece]:
        """Text as it settles; the last piece carries the finish reason. Cancels the generation if left early."""
        generation = run.generation
        assembler = TextAssembler(self.tokenizer, stops=run.stops)
        started = last = self._clock()
        try:
            async for landed in generation.in_runs():
                # The tokens that landed together make one piece: with speculation a step lands several a request,
                # and a piece a token made the client's stream a write a token, the gateway's dearest work.
                piece = Piece(text="")
                for event in landed:
                    if isinstance(event, Finished):
                        piece.text += assembler.flush()
                        piece.finish_reason = event.reason
                        break
                    now = self._clock()
                    histogram = (
                        self.metrics.time_to_first_token
                        if run.completion_tokens == 0
                        else self.metrics.inter_token_latency
                    )
                    histogram.observe(now - (started if run.completion_tokens == 0 else last))
                    last = now
                    run.completion_tokens += 1
                    self.metrics.tokens_generated.inc()
                    piece.text += assembler.add(event.token_id) if event.token_id not in self.tokenizer.stop_ids else ""
                    piece.tokens.append(event)
                    if assembler.stopped:
                        piece.finish_reason = "stop"
                        break
                yield piece
                if piece.finish_reason:
                    return
        finally:
            if not generation.finished:
                self.pipelines.cancel(generation)
