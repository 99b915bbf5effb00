"""Models stored in each quantised type a stage keeps: held in their blocks, sized as planned, and computing what HF
transformers computes from the same file (HF dequantises through gguf-py; the stage multiplies through its planes).

On the CPU the quantised matmul is the reference (dequantise, then matmul in the compute dtype): the same function the
GPU kernels are held to in tests/stage_worker/test_quant_matmul.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from strata.gguf import read_header
from strata.gguf.model import CacheType
from strata.gguf.reader import inspect_model
from strata.gguf.sources import open_source
from strata.gguf.testmodels import write_test_model
from strata.gguf.testmodels.shapes import K_QUANT_SHAPE
from strata.stage_worker.engine import Chunk, Engine
from strata.stage_worker.kv_pool import KVPool
from strata.stage_worker.loader import LoadProgress, config_from_header, load_stage
from strata.stage_worker.model import StageModel
from strata.stage_worker.weights.formats import FORMATS
from strata.stage_worker.weights.linear import PackedLinear, QuantizedRows
from strata_testbed.hf_reference import hf_reference

Q = GGMLQuantizationType
CPU = torch.device("cpu")
PROMPT = (1, 17, 200, 3, 45, 99, 12, 7, 250, 31, 64, 128)
GENERATED = 6


@dataclass(frozen=True)
class Stored:
    name: str
    weight_type: GGMLQuantizationType | None  # None: the small llama's own mix (Q8_0, Q4_0, F16, F32)


CASES = [Stored(f"every matrix {t.name}", t) for t in FORMATS] + [Stored("Q8_0, Q4_0 and F16 mixed", None)]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.name)
def model_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Stored]:
    case: Stored = request.param
    kquant = case.weight_type is not None and FORMATS[case.weight_type].block_elements == 256
    path = tmp_path_factory.mktemp("quantised") / "model.gguf"
    write_test_model(path, architecture="llama", shape=K_QUANT_SHAPE if kquant else None, weight_type=case.weight_type)
    return path, case


def load(path: Path, *, span: tuple[int, int] | None = None, dtype: torch.dtype = torch.float32) -> StageModel:
    source = open_source(str(path))
    try:
        header = read_header(source)
        start, end = span or (0, config_from_header(header).n_layer)
        return load_stage(
            source=source, header=header, layer_start=start, layer_end=end, dtype=dtype, device=CPU,
            progress=LoadProgress(),
        )  # fmt: skip
    finally:
        source.close()


def greedy(model: StageModel, prompt: tuple[int, ...], steps: int) -> tuple[list[int], torch.Tensor]:
    c = model.config
    pool = KVPool(
        n_layers=c.n_layer, context=64, parallel=1, key_width=c.kv_dim, value_width=c.kv_dim, type_k=CacheType.F32,
        type_v=CacheType.F32, dtype=torch.float32, device=CPU,
    )  # fmt: skip
    engine = Engine(model=model, pool=pool, device=CPU, dtype=torch.float32)
    first = Chunk(slot=0, start_position=0, length=len(prompt), token_ids=prompt, return_logits=True, sample=True)
    result = engine.step([first], None)
    logits, tokens = result.logits[0], [result.tokens[0].token_id]
    while len(tokens) < steps:
        chunk = Chunk(
            slot=0, start_position=len(prompt) + len(tokens) - 1, length=1, token_ids=(tokens[-1],), sample=True
        )
        tokens.append(engine.step([chunk], None).tokens[0].token_id)
    return tokens, logits


def test_the_stage_computes_what_hf_computes(model_file: tuple[Path, Stored]) -> None:
    path, _ = model_file
    tokens, logits = greedy(load(path), PROMPT, GENERATED)
    reference = hf_reference(path)
    with torch.inference_mode():
        expected = reference(torch.tensor([PROMPT])).logits[0]
        sequence = list(PROMPT)
        for _ in range(GENERATED):
            sequence.append(int(reference(torch.tensor([sequence])).logits[0, -1].argmax()))
    relative = (logits - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert float(relative.max()) <= 1e-4
    assert tokens == sequence[len(PROMPT) :]


def test_matrices_stay_in_the_file_type(model_file: tuple[Path, Stored]) -> None:
    path, case = model_file
    model = load(path)
    matrices = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(matrices) == 4 * model.config.n_layer + 1
    parts = [part for matrix in matrices for part in matrix.parts]
    kept = {part.ggml_type for part in parts if isinstance(part, QuantizedRows)}
    assert kept == ({case.weight_type} if case.weight_type is not None else {Q.Q8_0, Q.Q4_0})


@pytest.mark.parametrize("span", [None, (0, 1), (1, 2)], ids=["whole model", "first stage", "last stage"])
def test_a_stage_holds_what_the_plan_counts(model_file: tuple[Path, Stored], span: tuple[int, int] | None) -> None:
    """In the 2-byte compute dtype a GPU uses, the bytes a stage holds are the plan's resident bytes (within 2%)."""
    path, _ = model_file
    info = inspect_model(str(path))
    start, end = span or (0, info.block_count)
    model = load(path, span=(start, end), dtype=torch.bfloat16)
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    planned = sum(info.layer_resident_bytes[start:end])
    if start == 0:
        planned += info.resident_embedding_bytes
    if end == info.block_count:
        planned += info.resident_head_bytes
    assert abs(held - planned) <= 0.02 * planned, f"held {held:,} B, planned {planned:,} B"
