"""llama.cpp on the CPU as an independent oracle: the runtime that wrote the conventions Strata follows, through
llama-cpp-python (built from its sdist, which vendors llama.cpp's source).

HF transformers is the reference for the computation in f32; llama.cpp checks the reading of the file itself (tensor
layouts, RoPE conventions, scaling factors) by a second implementation that does not share HF's GGUF loader. Its CPU
matrix products quantise activations (to q8_0/q8_K) for quantised weights, so it agrees with an f32 computation to
within that rounding, not to f32 precision: the tests compare greedy picks and log-probabilities with tolerances
that say so.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

GGML_TYPE_F32 = 0  # ggml's type id, for an f32 KV cache


def llamacpp_logits(path: Path, ids: Sequence[int], *, threads: int = 2) -> torch.Tensor:
    """llama.cpp's logits at every position of `ids` ([len(ids), vocab], f32), from one prompt evaluation with an
    f32 KV cache."""
    from llama_cpp import Llama

    model = Llama(
        model_path=str(path),
        n_ctx=max(64, len(ids)),
        n_batch=max(64, len(ids)),
        n_threads=threads,
        n_gpu_layers=0,
        logits_all=True,
        type_k=GGML_TYPE_F32,
        type_v=GGML_TYPE_F32,
        verbose=False,
    )
    try:
        model.eval(list(ids))
        return torch.from_numpy(np.array(model.scores[: len(ids)], dtype=np.float32))
    finally:
        model.close()
