"""The reference the stage worker is held to: HF transformers' own reading of a GGUF file."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from strata.gguf.architectures import RopeStyle
from strata.stage_worker.model import Block, FeedForward, StageModel
from strata.stage_worker.weights.linear import PackedEmbedding, PackedLinear
from torch import Tensor
from transformers import PreTrainedModel


def hf_reference(
    path: Path, *, rope_parameters: Mapping[str, Any] | None = None, config: Mapping[str, Any] | None = None
) -> PreTrainedModel:
    """HF transformers' model for a GGUF file, through its own GGUF loader (dequantise, un-permute, rename).

    from_pretrained(gguf_file=) does the same steps but insists on `accelerate`, which Strata does not need.
    `rope_parameters` replace the config's: HF's GGUF loader reads no RoPE scaling from a file (and llama.cpp folds
    Llama 3.1's into a tensor HF does not read), so a test states the HF parameters its file was written from.
    `config` sets other fields HF's GGUF loader does not read (qwen3moe's expert width, moe_intermediate_size).
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    hf_config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    if rope_parameters is not None:
        hf_config.rope_parameters = dict(rope_parameters)
    for key, value in (config or {}).items():
        setattr(hf_config, key, value)
    # Eager attention: the plain formula, and the one implementation that applies Gemma 2's soft-capped scores.
    model: PreTrainedModel = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        hf_config, dtype=torch.float32, attn_implementation="eager"
    )
    checkpoint = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)  # type: ignore[no-untyped-call]
    tensors = checkpoint["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    allowed = {"lm_head.weight"} if hf_config.tie_word_embeddings else set()
    if set(missing) - allowed or unexpected:
        raise AssertionError(f"HF did not load the file whole: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.eval()  # type: ignore[no-untyped-call]
    return model


def hf_mixtral(path: Path) -> PreTrainedModel:
    """HF transformers' MixtralForCausalLM holding a Mixtral-style GGUF file's weights (architecture llama, with
    experts).

    HF's GGUF loader has no Mixtral: it reads a llama file into LlamaForCausalLM, whose names Mixtral shares for
    everything but the feed-forward. So HF's loader reads those (un-permuting q/k rows as it does for every llama file),
    and gguf-py's reader dequantises the router and the stacked experts, which the file lays out as Mixtral's own
    gate, gate_up_proj (gate rows over up rows per expert) and down_proj.
    """
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM, MixtralConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    llama = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(llama)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]  # type: ignore[no-untyped-call]
    reader = GGUFReader(path)
    stored = {tensor.name: tensor for tensor in reader.tensors}

    def values(name: str) -> Tensor:
        tensor = stored[name]
        return torch.from_numpy(np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).copy())

    for il in range(llama.num_hidden_layers):
        p, blk = f"model.layers.{il}.mlp.", f"blk.{il}."
        tensors[p + "gate.weight"] = values(blk + "ffn_gate_inp.weight")
        gate_up = (values(blk + "ffn_gate_exps.weight"), values(blk + "ffn_up_exps.weight"))
        tensors[p + "experts.gate_up_proj"] = torch.cat(gate_up, dim=1)
        tensors[p + "experts.down_proj"] = values(blk + "ffn_down_exps.weight")
    config = MixtralConfig(
        vocab_size=llama.vocab_size,
        hidden_size=llama.hidden_size,
        intermediate_size=llama.intermediate_size,
        num_hidden_layers=llama.num_hidden_layers,
        num_attention_heads=llama.num_attention_heads,
        num_key_value_heads=llama.num_key_value_heads,
        head_dim=llama.head_dim,
        rms_norm_eps=llama.rms_norm_eps,
        rope_parameters=llama.rope_parameters,
        max_position_embeddings=llama.max_position_embeddings,
        num_local_experts=int(stored_field(reader, "llama.expert_count")),
        num_experts_per_tok=int(stored_field(reader, "llama.expert_used_count")),
        tie_word_embeddings=llama.tie_word_embeddings,
        sliding_window=None,
    )
    model: PreTrainedModel = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        config, dtype=torch.float32, attn_implementation="eager"
    )
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    allowed = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed or unexpected:
        raise AssertionError(f"the Mixtral reference is not whole: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.eval()  # type: ignore[no-untyped-call]
    return model


def stored_field(reader: Any, key: str) -> Any:
    """A scalar key/value of a GGUF file, as gguf-py's reader reads it."""
    return reader.fields[key].contents()


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
        if not isinstance(block, Block) or not isinstance(block.ffn, FeedForward):
            raise TypeError(f"layer {i} is not a Block with a dense feed-forward")
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
