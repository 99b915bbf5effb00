"""The reference the stage worker is held to: HF transformers' own reading of a GGUF file."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel


def hf_reference(path: Path) -> PreTrainedModel:
    """HF transformers' model for a GGUF file, through its own GGUF loader (dequantise, un-permute, rename).

    from_pretrained(gguf_file=) does the same steps but insists on `accelerate`, which Strata does not need.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model: PreTrainedModel = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    checkpoint = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)  # type: ignore[no-untyped-call]
    tensors = checkpoint["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    allowed = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed or unexpected:
        raise AssertionError(f"HF did not load the file whole: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.eval()  # type: ignore[no-untyped-call]
    return model
