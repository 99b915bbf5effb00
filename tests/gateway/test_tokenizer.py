"""The gateway's tokenizer gives HF transformers' ids (AutoTokenizer with gguf_file=) on a hard corpus.

Byte-level BPE on every generated test model (llama-bpe and qwen2 pre-tokenizers), and a SentencePiece-style
vocabulary (tokenizer.ggml.model=llama: scores, byte fallback, BOS added) written here with gguf-py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter
from strata.gateway.tokenizer import GGUFTokenizer, TokenizerError, TokenizerSpec
from strata.gguf import read_model_header
from strata.gguf.testmodels import SMALL_SHAPES, write_test_model
from transformers import AutoTokenizer

CORPUS = [
    "Hello, world!",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "ünïcødé — naïve café, Ελληνικά, русский, 日本語のテキスト, 한국어",
    "emoji 😀👍🏽 👨‍👩‍👧 and flags 🇫🇷",
    "def f(x):\n    return {'a': x ** 2, \"b\": [1, 2, 3]}  # comment\n",
    "numbers 1234567890 3.14159 -42 1e-9",
    "it's I'LL we'd they're you've",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "",
    " ",
    "a" * 300,
]


def _spm_model(path: Path, *, architecture: str = "llama", space_prefix: bool = True) -> Path:
    """A SentencePiece-style vocabulary: control tokens, 256 byte tokens, scored pieces with the ▁ word marker;
    without `space_prefix` the file says no marker goes before the first word, as Gemma's do. (HF decides the
    prefix by the architecture, llama.cpp and the gateway by that key: the two agree on files written as Gemma's.)"""
    words = ["▁", "e", "l", "o", "h", "w", "r", "d", "▁h", "he", "ll", "llo", "▁he", "▁hello", "▁w", "or", "▁wor"]
    words += ["▁world", "x", "y", "▁x", "=", "(", ")", "▁def", "▁f", "de", "f", "a", "aa", "aaaa", "▁a", "▁aa"]
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *words]
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)
    writer = GGUFWriter(path, architecture)
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 64), (writer.add_embedding_length, 32)):
        add(value)
    writer.add_feed_forward_length(32)
    writer.add_head_count(1)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(pieces))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores([0.0] * (3 + 256) + [-float(i) for i in range(len(words))])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if not space_prefix:
        writer.add_add_space_prefix(False)
    writer.add_tensor("token_embd.weight", np.zeros((len(pieces), 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tokenizers")
    written = {
        key: write_test_model(folder / f"{key}.gguf", architecture=key, block_count=1).path for key in SMALL_SHAPES
    }
    return written | {
        "sentencepiece": _spm_model(folder / "sentencepiece.gguf"),
        "sentencepiece, no space prefix": _spm_model(
            folder / "spm-no-prefix.gguf", architecture="gemma3", space_prefix=False
        ),
    }


@pytest.mark.parametrize(
    "key",
    [
        pytest.param("llama", id="byte-level BPE with the llama-bpe pre-tokenizer matches HF"),
        pytest.param("mistral", id="a Mistral-shaped file matches HF"),
        pytest.param("qwen2", id="byte-level BPE with the qwen2 pre-tokenizer matches HF"),
        pytest.param("qwen3", id="a qwen3 file matches HF"),
        pytest.param("sentencepiece", id="a SentencePiece vocabulary with byte fallback and BOS matches HF"),
        pytest.param("sentencepiece, no space prefix", id="a SentencePiece file without a space prefix matches HF"),
        pytest.param("gemma3", id="a gemma3 file matches HF"),
    ],
)
def test_token_ids_and_text_match_hf_transformers(models: dict[str, Path], key: str) -> None:
    path = models[key]
    ours = GGUFTokenizer(TokenizerSpec.from_metadata(read_model_header(str(path))[0].metadata))
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in CORPUS:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), text


@pytest.mark.parametrize(
    "key",
    [
        pytest.param("qwen2", id="byte-level BPE, where one token may hold part of a character"),
        pytest.param("sentencepiece", id="SentencePiece with byte-fallback tokens and word-start marks"),
    ],
)
def test_the_raw_bytes_of_the_tokens_spell_the_decoded_text(models: dict[str, Path], key: str) -> None:
    path = models[key]
    ours = GGUFTokenizer(TokenizerSpec.from_metadata(read_model_header(str(path))[0].metadata))
    raw = ours.vocabulary_bytes
    assert len(raw) == ours.vocab_size
    for text in CORPUS:
        ids = ours.encode(text, add_special=False)
        spelled = b"".join(raw[i] for i in ids).decode("utf-8")
        if key == "sentencepiece":  # it marks the start of the text with a space that its decoder strips again
            spelled = spelled.removeprefix(" ")
        assert spelled == ours.decode(ids), text


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        pytest.param({"tokenizer.ggml.pre": "no-such-pre"}, "not a known pre-tokenizer", id="an unknown pre-tokenizer"),
        pytest.param({"tokenizer.ggml.model": "rwkv"}, "not supported", id="an unsupported tokenizer model"),
        pytest.param({"tokenizer.ggml.tokens": ()}, "no tokenizer.ggml.tokens", id="a file without tokens"),
    ],
)
def test_a_tokenizer_it_cannot_rebuild_faithfully_is_refused(
    models: dict[str, Path], changes: dict[str, object], message: str
) -> None:
    metadata = dict(read_model_header(str(models["llama"]))[0].metadata) | changes
    with pytest.raises(TokenizerError, match=message):
        GGUFTokenizer(TokenizerSpec.from_metadata(metadata))  # type: ignore[arg-type]
