"""Log-probabilities in OpenAI's two shapes: per token with its bytes and alternatives (chat), or parallel lists
with text offsets (completions)."""

from __future__ import annotations

from typing import Protocol

from strata.gateway import protocol as p
from strata.gateway.generation import Token
from strata.gateway.tokenizer import GGUFTokenizer


class TextOffset(Protocol):
    text_offset: int  # characters of generated text reported so far, carried across a stream's pieces


def chat_logprobs(tokenizer: GGUFTokenizer, tokens: list[Token]) -> p.ChatLogprobs:
    def entry(token_id: int, logprob: float) -> p.TopLogprob:
        raw = tokenizer.token_bytes(token_id)
        return p.TopLogprob(token=raw.decode("utf-8", errors="replace"), logprob=logprob, bytes=list(raw))

    content = []
    for t in tokens:
        head = entry(t.token_id, t.logprob)
        top = [entry(i, lp) for i, lp in t.top_logprobs]
        content.append(p.TokenLogprobContent(**head.model_dump(), top_logprobs=top))
    return p.ChatLogprobs(content=content)


def completion_logprobs(tokenizer: GGUFTokenizer, tokens: list[Token], *, run: TextOffset) -> p.CompletionLogprobs:
    def text(token_id: int) -> str:
        return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")

    result = p.CompletionLogprobs()
    for t in tokens:
        result.tokens.append(text(t.token_id))
        result.text_offset.append(run.text_offset)
        run.text_offset += len(result.tokens[-1])
        result.token_logprobs.append(t.logprob)
        result.top_logprobs.append({text(i): lp for i, lp in t.top_logprobs})
    return result
