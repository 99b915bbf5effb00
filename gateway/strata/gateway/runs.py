"""What the serving object keeps of an admitted request: one run per choice (its generation and the counts its usage
reports), and the pieces of text a run yields as they settle."""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.gateway import protocol as p
from strata.gateway.generation import Generation, Token


@dataclass
class Piece:
    text: str
    tokens: list[Token] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Run:
    """An admitted request: its generation, and the counts its usage reports."""

    generation: Generation
    prompt_tokens: int
    stops: tuple[str, ...]
    completion_tokens: int = 0
    text_offset: int = 0  # characters of generated text reported in logprobs so far

    def usage(self) -> p.Usage:
        return p.Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=p.PromptTokensDetails(cached_tokens=self.generation.cached),
        )


def usage_of(runs: list[Run]) -> p.Usage:
    """The prompt once (the choices share it), the completions of every choice."""
    completion = sum(run.completion_tokens for run in runs)
    prompt = runs[0].prompt_tokens
    return p.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=p.PromptTokensDetails(cached_tokens=runs[0].generation.cached),
    )
