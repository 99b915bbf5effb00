"""A mixture of experts on a GPU: the grouped matmul over experts in bf16 computes what a plain loop over each row's
experts computes in f32. (Its decode step runs eagerly: compiled and captured, it picked other tokens than eager
decoding on an H200; strata.stage_worker.engine refuses graphs for experts until that is understood.)

These need a CUDA device; CI has none, so they run on a GPU lease (`pytest tests/gpu` there, with the stage worker's
packages on the path) and are skipped elsewhere. The CPU runs the same grouped code in every test of
tests/stage_worker/test_experts.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from strata.gguf import read_header
from strata.gguf.model import CacheType
from strata.gguf.sources import open_source
from strata.gguf.testmodels import write_test_model
from strata.stage_worker.engine import Engine
from strata.stage_worker.experts import MixtureOfExperts
from strata.stage_worker.kv_pool import KVPool
from strata.stage_worker.loader import LoadProgress, load_stage
from torch import Tensor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU lease)")

GPU = torch.device("cuda:0")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_test_model(tmp_path_factory.mktemp("gpu") / "qwen3moe.gguf", architecture="qwen3moe").path


def engine(path: Path, *, dtype: torch.dtype, graphs: bool) -> Engine:
    source = open_source(str(path))
    try:
        header = read_header(source)
        model = load_stage(
            source=source, header=header, layer_start=0, layer_end=header.metadata["qwen3moe.block_count"],  # type: ignore[arg-type]
            dtype=dtype, device=GPU, progress=LoadProgress(),
        )  # fmt: skip
    finally:
        source.close()
    c = model.config
    pool = KVPool(
        n_layers=c.n_layer, context=128, parallel=2, key_width=c.kv_dim, value_width=c.kv_dim,
        type_k=CacheType.F32, type_v=CacheType.F32, dtype=dtype, device=GPU,
    )  # fmt: skip
    return Engine(model=model, pool=pool, device=GPU, dtype=dtype, cuda_graphs=graphs)


def loop_over_experts(moe: MixtureOfExperts, x: Tensor) -> Tensor:
    """The mixture's function, one row and one expert at a time, in f32."""
    chosen, weights = moe.route(x)
    gate_up, down = moe.w_gate_up.float(), moe.w_down.float()
    out = torch.zeros_like(x, dtype=torch.float32)
    for row in range(x.shape[0]):
        for expert, weight in zip(chosen[row].tolist(), weights[row], strict=True):
            gate, up = (gate_up[expert] @ x[row].float()).chunk(2)
            out[row] += weight * (down[expert] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("rows", [1, 4, 96], ids=["one row", "a decode batch", "a prefill chunk"])
def test_the_grouped_experts_in_bf16_match_a_loop_over_experts_in_f32(model_path: Path, rows: int) -> None:
    moe = engine(model_path, dtype=torch.bfloat16, graphs=False).model.layers[1].ffn
    assert isinstance(moe, MixtureOfExperts)
    x = torch.randn(rows, moe.w_down.shape[1], device=GPU, dtype=torch.bfloat16)
    with torch.inference_mode():
        grouped, looped = moe(x).float(), loop_over_experts(moe, x)
    assert float((grouped - looped).norm() / looped.norm()) <= 1e-2
