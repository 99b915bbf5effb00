"""The trained byte-level BPE vocabulary (vocab.json) and the tokenizer metadata test models carry.

Models larger than the trained vocabulary are padded with reserved control tokens, the way Llama 3 pads its own, so
a header-only 70B copy has a real-sized token table (which dominates a real header's size).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from gguf import TokenType

VOCAB_PATH = Path(__file__).with_name("vocab.json")
BOS_TOKEN = "<|endoftext|>"  # noqa: S105 (a token, not a password)
EOS_TOKEN = "<|im_end|>"  # noqa: S105
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True, kw_only=True)
class Vocabulary:
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    bos_token_id: int
    eos_token_id: int


@cache
def trained() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tokens, merges) as vocab.json stores them; special tokens are the last tokens."""
    data = json.loads(VOCAB_PATH.read_text(encoding="utf-8"))
    return tuple(data["tokens"]), tuple(data["merges"])


def special_tokens() -> frozenset[str]:
    return frozenset(token for token in trained()[0] if token.startswith("<|") and token.endswith("|>"))


def vocabulary(*, size: int | None = None) -> Vocabulary:
    """The trained vocabulary, padded with `<|reserved_special_token_N|>` to `size` tokens when asked."""
    tokens, merges = trained()
    target = len(tokens) if size is None else size
    if target < len(tokens):
        raise ValueError(f"vocabulary size {target} is below the trained {len(tokens)} tokens")
    padded = tokens + tuple(f"<|reserved_special_token_{i}|>" for i in range(target - len(tokens)))
    specials = special_tokens()
    types = tuple(
        int(TokenType.CONTROL) if token in specials or i >= len(tokens) else int(TokenType.NORMAL)
        for i, token in enumerate(padded)
    )
    return Vocabulary(
        tokens=padded,
        token_types=types,
        merges=merges,
        bos_token_id=padded.index(BOS_TOKEN),
        eos_token_id=padded.index(EOS_TOKEN),
    )
