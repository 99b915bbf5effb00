"""The model's own tokenizer, rebuilt from the GGUF metadata: byte-level BPE (gpt2) and SentencePiece-style BPE (llama).

A GGUF file carries no tokenizer.json, only llama.cpp's keys: the token list, merges (or scores), token types, the
special token ids and the BOS/EOS flags; `tokenizer.ggml.pre` names how text is split before merging. The same
Rust `tokenizers` engine HF transformers uses does the merging here, configured as HF's GGUF converter configures it,
so ids match HF token for token. An unknown pre-tokenizer name is refused rather than guessed: a wrong split would
tokenise every prompt differently from the way the model was trained, silently.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache, cached_property

from strata.gguf.executable import TOKENIZER_MODELS
from strata.gguf.values import Value
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

CONTROL, USER_DEFINED, BYTE = 3, 4, 6  # llama.cpp's token types

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex; None: GPT-2's own regex (what llama.cpp calls the default).
PRE_TOKENIZER_SPLITS: Mapping[str, str | None] = {
    "default": None,
    "gpt-2": None,
    "gpt2": None,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "dbrx": _LLAMA3,
    "falcon3": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "megrez": _QWEN2,
    "gpt-4o": _GPT4O,
    "llama4": _GPT4O,
}


class TokenizerError(ValueError):
    """The GGUF file describes a tokenizer this gateway cannot rebuild faithfully."""


@cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (how byte-level vocabularies spell tokens)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    spelled = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelled:
            spelled[b] = chr(256 + extra)
            extra += 1
    return spelled


@dataclass(frozen=True, kw_only=True)
class TokenizerSpec:
    """The tokenizer keys of a GGUF header, typed."""

    model: str  # tokenizer.ggml.model: gpt2 or llama
    pre: str
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    scores: tuple[float, ...]
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool  # SentencePiece: a word marker before the text's first word (Gemma's files say no)
    chat_template: str | None

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Value]) -> TokenizerSpec:
        def text(key: str) -> str | None:
            value = metadata.get(key)
            return value if isinstance(value, str) else None

        def strings(key: str) -> tuple[str, ...]:
            value = metadata.get(key, ())
            return tuple(str(v) for v in value) if isinstance(value, tuple) else ()

        def number(key: str) -> int | None:
            value = metadata.get(key)
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        def flag(key: str, default: bool) -> bool:
            value = metadata.get(key)
            return value if isinstance(value, bool) else default

        model = text("tokenizer.ggml.model")
        if model not in TOKENIZER_MODELS:  # the models that strata.gguf's check accepts, so it refuses the others first
            raise TokenizerError(f"tokenizer.ggml.model {model!r} is not supported (gpt2 or llama)")
        tokens = strings("tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError("the file has no tokenizer.ggml.tokens")
        raw_types = metadata.get("tokenizer.ggml.token_type", ())
        types = tuple(int(t) for t in raw_types) if isinstance(raw_types, tuple) else ()
        raw_scores = metadata.get("tokenizer.ggml.scores", ())
        scores = tuple(float(s) for s in raw_scores) if isinstance(raw_scores, tuple) else ()
        return cls(
            model=model,
            pre=text("tokenizer.ggml.pre") or "default",
            tokens=tokens,
            token_types=types or (1,) * len(tokens),
            merges=strings("tokenizer.ggml.merges"),
            scores=scores,
            bos_id=number("tokenizer.ggml.bos_token_id"),
            eos_id=number("tokenizer.ggml.eos_token_id"),
            eot_id=number("tokenizer.ggml.eot_token_id"),
            # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise, and not to a BPE one.
            add_bos=flag("tokenizer.ggml.add_bos_token", model == "llama"),
            add_eos=flag("tokenizer.ggml.add_eos_token", False),
            add_space_prefix=flag("tokenizer.ggml.add_space_prefix", True),  # llama.cpp's default, as HF's converter
            chat_template=text("tokenizer.chat_template"),
        )


class GGUFTokenizer:
    """Encode and decode with the file's vocabulary; knows which ids end a generation."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        self._tokenizer = _byte_level(spec) if spec.model == "gpt2" else _sentencepiece(spec)
        specials = [
            AddedToken(token, normalized=False, special=True)
            for token, kind in zip(spec.tokens, spec.token_types, strict=False)
            if kind == CONTROL and (spec.model != "gpt2" or set(token) <= set(byte_alphabet().values()))
        ]
        self._tokenizer.add_special_tokens(specials)
        vocab = self._tokenizer.get_vocab()
        self._tokenizer.add_tokens(
            [
                AddedToken(token, normalized=False, special=False)
                for token, kind in zip(spec.tokens, spec.token_types, strict=False)
                if kind == USER_DEFINED and token in vocab
            ]
        )
        self.special_ids = frozenset(i for i, kind in enumerate(spec.token_types) if kind == CONTROL)
        self.stop_ids = frozenset(i for i in (spec.eos_id, spec.eot_id) if i is not None)

    @property
    def vocab_size(self) -> int:
        return len(self.spec.tokens)

    def token(self, token_id: int) -> str:
        return self.spec.tokens[token_id] if 0 <= token_id < len(self.spec.tokens) else ""

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        """Ids of `text`; special tokens written in the text stay whole; BOS/EOS as the file's flags say."""
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False).ids
        if add_special and self.spec.add_bos and self.spec.bos_id is not None:
            ids.insert(0, self.spec.bos_id)
        if add_special and self.spec.add_eos and self.spec.eos_id is not None:
            ids.append(self.spec.eos_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        text: str = self._tokenizer.decode(list(ids), skip_special_tokens=skip_special)
        return text

    @cached_property
    def vocabulary_bytes(self) -> tuple[bytes, ...]:
        """The exact bytes each token adds to the text, whole or part of a UTF-8 character (what a grammar matcher
        walks); a control token stands for no text and gets b""."""
        return _vocabulary_bytes(self.spec)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (OpenAI's logprobs report them beside the text)."""
        return self.decode([token_id], skip_special=False).encode("utf-8", errors="replace")


def _vocabulary_bytes(spec: TokenizerSpec) -> tuple[bytes, ...]:
    if spec.model == "gpt2":
        unspell = {c: b for b, c in byte_alphabet().items()}

        def raw(token: str) -> bytes:
            return bytes(unspell[c] for c in token) if set(token) <= unspell.keys() else token.encode()
    else:

        def raw(token: str) -> bytes:
            return token.replace("▁", " ").encode()

    result = []
    for token, kind in zip(spec.tokens, spec.token_types, strict=False):
        if kind == CONTROL:
            result.append(b"")
        elif kind == BYTE and spec.model == "llama" and len(token) == 6 and token.startswith("<0x"):
            result.append(bytes([int(token[3:5], 16)]))
        else:
            result.append(raw(token))
    return tuple(result)


def _byte_level(spec: TokenizerSpec) -> Tokenizer:
    if spec.pre not in PRE_TOKENIZER_SPLITS:
        raise TokenizerError(
            f"tokenizer.ggml.pre {spec.pre!r} is not a known pre-tokenizer ({', '.join(sorted(PRE_TOKENIZER_SPLITS))})"
        )
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(spec.tokens)
    }
    merges = [_pair(merge) for merge in spec.merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    split = PRE_TOKENIZER_SPLITS[spec.pre]
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(spec: TokenizerSpec) -> Tokenizer:
    vocab = {token: index for index, token in enumerate(spec.tokens)}
    merges = [_pair(m) for m in spec.merges] if spec.merges else _merges_from_scores(spec, vocab)
    unk = next((t for t, kind in zip(spec.tokens, spec.token_types, strict=False) if kind == 2), None)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prepend = "first" if spec.add_space_prefix else "never"
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    steps += [decoders.Strip(content=" ", left=1)] if spec.add_space_prefix else []  # the marker it added
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def _merges_from_scores(spec: TokenizerSpec, vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """SentencePiece files list no merges: every split of a token into two known tokens, best-scored first."""
    if len(spec.scores) != len(spec.tokens):
        raise TokenizerError("a SentencePiece vocabulary needs one score per token (tokenizer.ggml.scores)")
    found: list[tuple[str, str, float]] = []
    for token, score in zip(spec.tokens, spec.scores, strict=True):
        local = [
            (token[:i], token[i:], score) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab
        ]
        found.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]
