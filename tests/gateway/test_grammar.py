"""Grammars over the generated model's vocabulary: a step's masks computed together match each one alone, a failed
matcher is reported rather than masked around, and compiled grammars are cached per source."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from strata.gateway.errors import InvalidRequestError
from strata.gateway.grammar import ConstraintViolationError, Grammars
from strata.gateway.tokenizer import GGUFTokenizer, TokenizerSpec
from strata.gguf import read_model_header
from strata.gguf.testmodels import SMALL_SHAPES, write_test_model

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    {"enum": ["red", "green"]},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> GGUFTokenizer:
    path: Path = write_test_model(
        tmp_path_factory.mktemp("grammar") / "m.gguf", architecture="qwen2", block_count=1
    ).path
    return GGUFTokenizer(TokenizerSpec.from_metadata(read_model_header(str(path))[0].metadata))


@pytest.mark.parametrize("prefix", ["", '{"a":', "[true,"], ids=["at the start", "mid-object", "mid-array"])
def test_masks_computed_together_match_each_alone(tokenizer: GGUFTokenizer, prefix: str) -> None:
    grammars = Grammars(tokenizer)
    constraints = [grammars.start(grammars.json_schema(s, param="schema")) for s in SCHEMAS]
    for constraint in constraints:
        for token in tokenizer.encode(prefix, add_special=False):
            try:
                constraint.advance(token)
            except ConstraintViolationError:
                break
    alone = [c.mask() if not c.matcher.is_error() else None for c in constraints]
    assert grammars.masks(constraints) == alone
    assert any(alone)


def test_a_matcher_that_failed_gets_no_mask(tokenizer: GGUFTokenizer) -> None:
    grammars = Grammars(tokenizer)
    good, bad = (grammars.start(grammars.json_schema(SCHEMAS[0], param="schema")) for _ in range(2))
    with pytest.raises(ConstraintViolationError):
        bad.advance(tokenizer.encode("hello", add_special=False)[0])  # an object starts with {
    masks = grammars.masks([good, bad])
    assert masks[0] is not None
    assert masks[1] is None


def test_a_grammar_is_compiled_once_per_schema(tokenizer: GGUFTokenizer) -> None:
    grammars = Grammars(tokenizer)
    first = grammars.json_schema(SCHEMAS[0], param="schema")
    same = grammars.json_schema(dict(reversed(list(SCHEMAS[0].items()))), param="schema")
    assert same is first


def test_a_schema_it_cannot_enforce_names_the_parameter(tokenizer: GGUFTokenizer) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        Grammars(tokenizer).json_schema({"type": "nonsense"}, param="response_format.json_schema.schema")
    assert caught.value.param == "response_format.json_schema.schema"


@pytest.mark.parametrize("vocab", [1000, 1024], ids=["a vocabulary of 1000", "a vocabulary that is a multiple of 32"])
def test_a_mask_holds_one_bit_per_token_in_whole_words(tmp_path: Path, vocab: int) -> None:
    shape = dataclasses.replace(SMALL_SHAPES["qwen2"], vocab_size=vocab)
    path = write_test_model(tmp_path / "m.gguf", architecture="qwen2", block_count=1, shape=shape).path
    grammars = Grammars(GGUFTokenizer(TokenizerSpec.from_metadata(read_model_header(str(path))[0].metadata)))
    constraints = [grammars.start(grammars.json_schema(s, param="schema")) for s in SCHEMAS]
    size = (vocab + 31) // 32 * 4
    assert len(constraints[0].mask()) == size
    assert [len(m or b"") for m in grammars.masks(constraints)] == [size] * len(constraints)


def test_a_drafts_masks_are_those_of_advancing_one_token_at_a_time_and_the_matcher_rolls_back(
    tokenizer: GGUFTokenizer,
) -> None:
    grammars = Grammars(tokenizer)
    grammar = grammars.json_schema(SCHEMAS[0], param="schema")
    drafting, stepping = grammars.start(grammar), grammars.start(grammar)
    text = tokenizer.encode('{"a":12', add_special=False)
    wrong = tokenizer.encode("x", add_special=False)
    assert drafting.allows([*text, *wrong]) == len(text), "a draft is allowed up to the first refused token"
    before = drafting.mask()
    masks = drafting.draft_masks(text)
    assert drafting.mask() == before, "the matcher is back where it was"
    expected = []
    for token in text:
        stepping.advance(token)
        expected.append(stepping.mask())
    assert masks == expected
