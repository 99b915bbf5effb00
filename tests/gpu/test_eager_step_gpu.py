"""An eager step on a GPU (a prefill chunk) takes one launch each for its add + RMS norm and its feed-forward's
activation (kernels/norms_and_gates_triton.py) and, for a lone long prompt over a q8_0 pool, for its K/V read back
(kernels/kv_read_triton.py): the first token and its log-probability are those of the same step through the
references (torch's norms, activation and Store.read).

These need a CUDA device; CI has none, so they run on a GPU lease and are skipped elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from strata.gguf.model import CacheType
from strata.gguf.testmodels import write_test_model
from strata.gguf.testmodels.shapes import K_QUANT_SHAPE
from strata.stage_worker import kv_stores
from strata.stage_worker.engine import Chunk, Engine
from strata.stage_worker.kernels import kv_read_triton, norms_and_gates, norms_and_gates_triton
from strata.stage_worker.kv_pool import KVPool
from strata.stage_worker.model import FLASH_MIN_ROWS
from strata_testbed.stages import load_spans

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU lease)")

Q = GGMLQuantizationType
LAYERS = 3


@dataclass(frozen=True)
class Case:
    name: str
    weight_type: GGMLQuantizationType
    cache: CacheType
    prompt: int  # tokens: FLASH_MIN_ROWS or more attend through flash attention over the read-back cells
    kernels: tuple[str, ...]  # the eager kernels the step must have run


LONG = FLASH_MIN_ROWS + 76
ALL = ("norm", "activation", "read")
CASES = [
    Case("Q8_0, a lone long prompt over a q8_0 pool", Q.Q8_0, CacheType.Q8_0, LONG, ALL),
    Case("Q4_K, a lone long prompt over an f16 pool", Q.Q4_K, CacheType.F16, LONG, ("norm", "activation")),
    Case("Q8_0, a chunk of 300 rows", Q.Q8_0, CacheType.Q8_0, 300, ("norm", "activation")),
]


def engine_for(path: Path, cache: CacheType, dtype: torch.dtype) -> Engine:
    device = torch.device("cuda")
    (model,) = load_spans(path, dtype=dtype, device=device)
    c = model.config
    pool = KVPool(
        n_layers=c.n_layer, context=2048, parallel=2, key_width=c.kv_dim, value_width=c.kv_dim,
        type_k=cache, type_v=cache, dtype=dtype, device=device,
    )  # fmt: skip
    return Engine(model=model, pool=pool, device=device, dtype=dtype)


def first_token(path: Path, case: Case) -> tuple[int, float]:
    engine = engine_for(path, case.cache, torch.float32)
    vocab = engine.model.config.vocab_size
    prompt = tuple(int(t) for t in np.random.default_rng(case.prompt).integers(1, vocab, size=case.prompt))
    result = engine.step([Chunk(slot=0, start_position=0, length=len(prompt), token_ids=prompt, sample=True)], None)
    return result.tokens[0].token_id, result.tokens[0].logprob


def counted(calls: list[str], name: str, original: Callable[..., object]) -> Callable[..., object]:
    def call(*args: object, **kwargs: object) -> object:
        calls.append(name)
        return original(*args, **kwargs)

    return call


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_eager_kernels_give_the_references_first_token(
    case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shape = K_QUANT_SHAPE if case.weight_type is Q.Q4_K else None
    path = write_test_model(
        tmp_path / "model.gguf", architecture="llama", block_count=LAYERS, shape=shape, weight_type=case.weight_type
    ).path
    calls: list[str] = []
    norm, activation = norms_and_gates.kernel_add_rms_norm, norms_and_gates_triton.activated
    monkeypatch.setattr(norms_and_gates, "kernel_add_rms_norm", counted(calls, "norm", norm))
    monkeypatch.setattr(norms_and_gates_triton, "activated", counted(calls, "activation", activation))
    monkeypatch.setattr(kv_read_triton, "read_q8", counted(calls, "read", kv_read_triton.read_q8))
    token, logprob = first_token(path, case)
    assert set(case.kernels) <= set(calls), f"the step ran {sorted(set(calls))}, not every one of {case.kernels}"

    monkeypatch.setattr(norms_and_gates, "_eager_on_gpu", lambda x: False)
    monkeypatch.setattr(kv_stores, "read_rows", lambda store, cells, dtype: store.read(cells, dtype=dtype))
    calls.clear()
    expected_token, expected_logprob = first_token(path, case)
    assert not calls, f"the reference step still ran {sorted(set(calls))}"
    assert token == expected_token
    assert logprob == pytest.approx(expected_logprob, abs=1e-4)


def eager_kernels_compiled() -> int:
    """Kernels of the eager step's modules Triton has compiled in this process so far."""
    from triton.runtime.jit import JITFunction

    functions = [value for module in (norms_and_gates_triton, kv_read_triton) for value in vars(module).values()
                 if isinstance(value, JITFunction)]  # fmt: skip
    return sum(len(entry[0]) for fn in functions for entry in fn.device_caches.values())


def test_after_warm_up_a_long_prompt_compiles_no_eager_kernel(tmp_path: Path) -> None:
    """The warm-up ran each eager kernel (its prefill steps, and warm_steps.warm_reads for the read-back no warm step
    is long enough for): a lone long prompt over a q8_0 pool, then a chunk after it, compile nothing while serving."""
    path = write_test_model(tmp_path / "model.gguf", architecture="llama", block_count=LAYERS, weight_type=Q.Q8_0).path
    engine = engine_for(path, CacheType.Q8_0, torch.bfloat16)
    engine.warm_up()
    before = eager_kernels_compiled()
    assert before > 0, "the warm-up compiled no eager kernel: the count below would prove nothing"
    prompt = (5,) * LONG
    engine.step([Chunk(slot=0, start_position=0, length=LONG, token_ids=prompt, sample=True)], None)
    engine.step([Chunk(slot=0, start_position=LONG, length=300, token_ids=(6,) * 300, sample=True)], None)
    assert eager_kernels_compiled() == before
