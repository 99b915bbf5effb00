"""Grammar-constrained decoding: what the model may write next, as a mask over the GGUF's own vocabulary.

llguidance (a structured-output backend of llama.cpp, vLLM and SGLang) turns a JSON schema or a Lark grammar
into a matcher that, given the tokens so far, says which tokens may come next. It was chosen over xgrammar and
outlines-core by measurement (docs/benchmarks.md): a schema compiles in about a millisecond where the others take
half a second to seconds on a 128k vocabulary, a mask takes tens to hundreds of microseconds, and every JSON it let
through parsed (xgrammar let raw control characters into strings).

The grammar's state lives here, in the gateway, beside the generation it constrains, and the mask travels in the
step (SlotChunk.allowed_tokens) to the last stage, which samples inside it. That keeps the stages free of tokenizers
and grammars, keeps each slot's state with its own generation (several slots step together, each with its own mask),
and needs nothing new when a slot's step carries several positions: each sampled position gets its own mask.

Schemas are untrusted input: llguidance refuses a remote `$ref` instead of fetching it, bounds its own work per
token (its parser limits), and a schema it rejects is an InvalidRequestError naming the parameter. Whitespace between
JSON tokens is not allowed at all (compact JSON), so the model cannot pad forever; a generation ends when the
grammar has nothing more to add.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from llguidance import LLExecutor, LLMatcher, LLTokenizer, TokenizerWrapper
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par
from strata.gateway.errors import InvalidRequestError
from strata.gateway.protocol import ResponseFormat
from strata.gateway.tokenizer import GGUFTokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of its type stubs only

GRAMMAR_CACHE_ENTRIES = 256
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
# Any JSON object; strings, numbers and nesting are unbounded here, so only max_tokens ends a runaway value.
ANY_OBJECT: Mapping[str, Any] = {"type": "object"}


class ConstraintViolationError(RuntimeError):
    """A token outside the mask came back from the pipeline, or the matcher failed: the output is no longer
    guaranteed, so the generation ends with an error rather than text the client would trust."""


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar (llguidance's serialised form), ready to start matchers from."""

    source: str


class _Wrapped:
    """The GGUF vocabulary as llguidance's TokenizerWrapper reads it: each token's raw bytes; control tokens carry
    llguidance's 0xFF marker so no text can spell them."""

    def __init__(self, tokenizer: GGUFTokenizer) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.spec.eos_id if tokenizer.spec.eos_id is not None else 0
        self.bos_token_id = tokenizer.spec.bos_id
        self.special_token_ids = sorted(tokenizer.special_ids)
        self.tokens = [
            b"\xff" + tokenizer.token(i).encode() if i in tokenizer.special_ids else raw
            for i, raw in enumerate(tokenizer.vocabulary_bytes)
        ]

    def __call__(self, text: bytes) -> list[int]:
        return self._tokenizer.encode(text.decode("utf-8", errors="replace"), add_special=False)


class Grammars:
    """Compiles grammars for one model's vocabulary and starts matchers; compiled grammars are cached per source."""

    def __init__(self, tokenizer: GGUFTokenizer) -> None:
        self._tokenizer = tokenizer
        self._compiled: OrderedDict[str, Grammar] = OrderedDict()

    @cached_property
    def _ll(self) -> LLTokenizer:
        # Built on first use: it walks the whole vocabulary (a few hundred ms for 128k tokens).
        stops = sorted(self._tokenizer.stop_ids) or None
        return LLTokenizer(TokenizerWrapper(_Wrapped(self._tokenizer)), eos_token=stops)

    @cached_property
    def special_ids(self) -> Mapping[str, int]:
        """The vocabulary's special tokens by their text, for grammars that name one (Lark's <[id]>)."""
        return {self._tokenizer.token(i): i for i in sorted(self._tokenizer.special_ids)}

    def json_schema(self, schema: Mapping[str, Any], *, param: str) -> Grammar:
        """The grammar of JSON documents valid for `schema`; a schema llguidance rejects is a 400 naming `param`."""
        try:
            source = LLMatcher.grammar_from_json_schema(json.dumps(schema, sort_keys=True), defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"{param}: the schema is not valid JSON: {exc}", param=param) from None
        return self._checked(source, param=param)

    def response(self, response_format: ResponseFormat | None) -> Grammar | None:
        """The grammar a chat request's response_format asks for; None for free text."""
        if response_format is None or response_format.type == "text":
            return None
        if response_format.json_schema is None:
            return self.json_schema(ANY_OBJECT, param="response_format")
        schema = response_format.json_schema.schema_ or ANY_OBJECT
        return self.json_schema(schema, param="response_format.json_schema.schema")

    def lark(self, source: str, *, param: str) -> Grammar:
        """A Lark grammar (llguidance's dialect, which embeds JSON schemas with %json)."""
        return self._checked(LLMatcher.grammar_from_lark(source), param=param)

    def _checked(self, source: str, *, param: str) -> Grammar:
        cached = self._compiled.get(source)
        if cached is not None:
            self._compiled.move_to_end(source)
            return cached
        error = LLMatcher.validate_grammar(source, self._ll)
        if error:
            raise InvalidRequestError(f"{param}: the schema cannot be enforced: {error}", param=param)
        grammar = Grammar(source)
        self._compiled[source] = grammar
        if len(self._compiled) > GRAMMAR_CACHE_ENTRIES:
            self._compiled.popitem(last=False)
        return grammar

    @cached_property
    def _executor(self) -> LLExecutor:
        return LLExecutor()  # llguidance's own threads, which compute a step's masks side by side without the GIL

    @cached_property
    def mask_bytes(self) -> int:
        """One mask's size: a bit per token of the vocabulary, in whole 32-bit words."""
        return (self._ll.vocab_size + 31) // 32 * 4

    def start(self, grammar: Grammar) -> Constraint:
        return Constraint(LLMatcher(self._ll, grammar.source, log_level=0), grammars=self)

    def masks(self, constraints: Sequence[Constraint]) -> list[bytes | None]:
        """The next-token mask of each constraint (None where its matcher failed), computed in parallel: a step
        carries one per constrained slot, and on a large vocabulary one mask takes a few hundred microseconds."""
        if len(constraints) == 1:
            try:
                return [constraints[0].mask()]
            except ConstraintViolationError:
                return [None]
        bitmask = allocate_token_bitmask(len(constraints), self._ll.vocab_size)
        fill_next_token_bitmask_par(self._executor, [(c.matcher, i) for i, c in enumerate(constraints)], bitmask)
        return [None if c.matcher.is_error() else row.tobytes() for c, row in zip(constraints, bitmask, strict=True)]


class Constraint:
    """One generation's place in its grammar: the mask for the next token, advanced by each token sampled."""

    def __init__(self, matcher: LLMatcher, *, grammars: Grammars) -> None:
        self._matcher = matcher
        self.grammars = grammars  # whose threads compute this constraint's masks with others of the same step
        self._check()

    @property
    def matcher(self) -> LLMatcher:
        return self._matcher

    @property
    def error(self) -> str:
        return self._matcher.get_error()

    def mask(self) -> bytes:
        """Bit i%32 of little-endian uint32 word i/32 is set when token i may come next."""
        mask = self._matcher.compute_bitmask()
        self._check()
        # llguidance writes a word more than the vocabulary needs when its size is a multiple of 32 (most real
        # ones): cut it, or a stage would refuse a mask longer than its vocabulary.
        return mask[: self.grammars.mask_bytes]

    def allows(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, from the first, the grammar allows to come next (a draft is cut there)."""
        return int(self._matcher.validate_tokens(list(tokens)))

    def draft_masks(self, draft: Sequence[int]) -> list[bytes]:
        """The mask of the pick after each token of a draft (one the grammar `allows` whole): the matcher takes the
        draft, gives each mask, and rolls back to where it was."""
        masks: list[bytes] = []
        consumed = 0
        try:
            for token in draft:
                self.advance(token)
                consumed += 1
                masks.append(self.mask())
        finally:
            if consumed:
                self._matcher.rollback(consumed)
        return masks

    def advance(self, token_id: int) -> None:
        if not self._matcher.consume_token(token_id):
            raise ConstraintViolationError(f"token {token_id} is outside the grammar: {self._matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """The grammar allows nothing more: the output is whole and the generation can end without another step."""
        return self._matcher.is_stopped()

    def _check(self) -> None:
        if self._matcher.is_error():
            raise ConstraintViolationError(f"the grammar matcher failed: {self._matcher.get_error()}")
