"""Generated test models are real: HF transformers loads each one offline, and the vocabulary is reproducible."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from strata.gguf.testmodels import SMALL_SHAPES, write_test_model
from strata.gguf.testmodels.train_vocab import VOCAB_PATH, train

FAMILIES = [
    pytest.param("llama", "LlamaForCausalLM", id="a llama model loads as LlamaForCausalLM"),
    pytest.param("mistral", "LlamaForCausalLM", id="a mistral model, written as llama.cpp writes it, loads"),
    pytest.param("qwen2", "Qwen2ForCausalLM", id="a qwen2 model with attention biases loads as Qwen2ForCausalLM"),
    pytest.param("qwen3", "Qwen3ForCausalLM", id="a qwen3 model with q/k norms and a tied head loads"),
]


@pytest.mark.parametrize(("family", "model_class"), FAMILIES)
def test_transformers_loads_the_generated_model_and_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str, model_class: str
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    written = write_test_model(tmp_path / f"{family}.gguf", architecture=family, seed=7)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=written.path.name)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file=written.path.name)

    assert type(model).__name__ == model_class
    assert model.config.num_hidden_layers == written.shape.block_count
    assert model.config.vocab_size == written.vocab_size
    assert model.config.tie_word_embeddings == written.shape.tied_output
    file_norm = next(t for t in gguf.GGUFReader(written.path).tensors if t.name == "output_norm.weight")
    assert np.array_equal(model.model.norm.weight.detach().numpy(), np.asarray(file_norm.data))
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, written.vocab_size)

    text = "Strata splits a model across GPUs: café, 東京, 1024 tokens."
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids: list[int] = tokenizer(rendered).input_ids
    vocab: dict[str, int] = tokenizer.get_vocab()
    assert ids.count(vocab["<|im_start|>"]) == 2  # special tokens stay whole
    assert ids.count(vocab["<|im_end|>"]) == 1


@pytest.mark.parametrize("family", list(SMALL_SHAPES), ids=lambda f: f"the {f} model is the same for the same seed")
def test_generation_is_deterministic_from_the_seed(tmp_path: Path, family: str) -> None:
    first = write_test_model(tmp_path / "a.gguf", architecture=family, seed=3)
    second = write_test_model(tmp_path / "b.gguf", architecture=family, seed=3)
    other = write_test_model(tmp_path / "c.gguf", architecture=family, seed=4)
    assert first.path.read_bytes() == second.path.read_bytes()
    assert first.path.read_bytes() != other.path.read_bytes()


def test_the_committed_vocabulary_is_what_the_training_script_produces() -> None:
    assert json.loads(VOCAB_PATH.read_text(encoding="utf-8")) == train()


def test_a_k_quant_model_at_a_width_not_of_whole_blocks_is_refused(tmp_path: Path) -> None:
    """The small llama shape's 128-wide rows are half a Q4_K block: the writer says so, not a file of empty tensors."""
    with pytest.raises(ValueError, match="Q4_K rows are whole blocks of 256 values; 128 columns are not"):
        write_test_model(tmp_path / "model.gguf", architecture="llama", weight_type=gguf.GGMLQuantizationType.Q4_K)
