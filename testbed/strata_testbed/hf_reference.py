"""The reference the stage worker is held to: HF transformers' own reading of a GGUF file."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from strata.gguf.architectures import RopeStyle
from strata.stage_worker.model import Block, StageModel
from strata.stage_worker.weights.linear import PackedEmbedding, PackedLinear
from torch import Tensor
from transformers import PreTrainedModel


def hf_reference(path: Path, *, rope_parameters: Mapping[str, Any] | None = None) -> PreTrainedModel:
    """HF transformers' model for a GGUF file, through its own GGUF loader (dequantise, un-permute, rename).

    from_pretrained(gguf_file=) does the same steps but insists on `accelerate`, which Strata does not need.
    `rope_parameters` replace the config's: HF's GGUF loader reads no RoPE scaling from a file (and llama.cpp folds
    Llama 3.1's into a tensor HF does not read), so a test states the HF parameters its file was written from.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    if rope_parameters is not None:
        config.rope_parameters = dict(rope_parameters)
    # Eager attention: the plain formula, and the one implementation that applies Gemma 2's soft-capped scores.
    model: PreTrainedModel = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        config, dtype=torch.float32, attn_implementation="eager"
    )
    checkpoint = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)  # type: ignore[no-untyped-call]
    tensors = checkpoint["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    allowed = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed or unexpected:
        raise AssertionError(f"HF did not load the file whole: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.eval()  # type: ignore[no-untyped-call]
    return model


def hf_from_stage(stage: StageModel) -> PreTrainedModel:
    """HF's LlamaForCausalLM holding a whole-model stage's own weights (no second read of the file).

    For files too large for HF's GGUF loader to dequantise in reasonable time (an 8B Q8_0 file on a benchmark
    machine). The matrices are the stage's own dequantised to its compute dtype (norms are shared), with attn_q/attn_k
    un-permuted back to HF's order (llama.cpp's converter permutes their rows for "normal"
    RoPE); HF's own RoPE and attention then compute the reference.
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    c = stage.config
    if not (stage.is_first and stage.is_last) or c.rope_style is not RopeStyle.NORM or c.attention_bias or c.qk_norm:
        raise ValueError("hf_from_stage builds plain llama models from a stage that holds every layer")
    if stage.token_embd is None or stage.output_norm is None or stage.output is None:
        raise ValueError("the stage holds no embedding or output head")
    config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.dim,
        intermediate_size=c.ffn_dim,
        num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head,
        num_key_value_heads=c.n_head_kv,
        head_dim=c.head_dim,
        rms_norm_eps=c.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )

    def unpermute(weight: Tensor, heads: int) -> Tensor:
        rows = weight.shape[0]
        return weight.reshape(heads, rows // heads // 2, 2, -1).transpose(1, 2).reshape(weight.shape).contiguous()

    dtype = stage.output_norm.weight.dtype

    def dense(module: torch.nn.Module) -> Tensor:
        if not isinstance(module, PackedLinear | PackedEmbedding):
            raise TypeError(f"{type(module).__name__} is not a matrix the loader builds")
        return module.dense(dtype)

    tensors = {
        "model.embed_tokens.weight": dense(stage.token_embd),
        "model.norm.weight": stage.output_norm.weight,
        "lm_head.weight": dense(stage.output),
    }
    for i, block in enumerate(stage.layers):
        if not isinstance(block, Block):
            raise TypeError(f"layer {i} is not a Block")
        p = f"model.layers.{i}."
        q, k, v = torch.split(dense(block.attn.wqkv), [c.q_dim, c.kv_dim, c.kv_dim])
        gate, up = torch.split(dense(block.ffn.w_gate_up), c.ffn_dim)
        tensors |= {
            p + "self_attn.q_proj.weight": unpermute(q, c.n_head),
            p + "self_attn.k_proj.weight": unpermute(k, c.n_head_kv),
            p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": dense(block.attn.wo),
            p + "mlp.gate_proj.weight": gate,
            p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": dense(block.ffn.w_down),
            p + "input_layernorm.weight": block.attn_norm.weight,
            p + "post_attention_layernorm.weight": block.ffn_norm.weight,
        }
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(tensors, strict=True, assign=True)
    model.model.rotary_emb = LlamaRotaryEmbedding(config).to(
        stage.output_norm.weight.device
    )  # built on meta above; rebuilt real
    model.eval()  # type: ignore[no-untyped-call]
    return model


def greedy(model: PreTrainedModel, prompt: list[int] | tuple[int, ...], new_tokens: int) -> list[int]:
    """The model's greedy continuation of `prompt`, `new_tokens` long, recomputed from scratch each step (no cache:
    the plainest reading of the model)."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]
