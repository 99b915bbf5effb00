"""A stage runs on the device it is given, whatever the calling thread's current device: the checks one GPU allows.

These need a CUDA device; CI has none, so they run on a GPU lease (`pytest tests/gpu` there, with the stage worker's
packages on the path) and are skipped elsewhere. What they guard is also exercised on the CPU by every stage test.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from strata.gguf import read_header
from strata.gguf.model import CacheType
from strata.gguf.sources import open_source
from strata.gguf.testmodels import write_test_model
from strata.stage_worker.engine import Chunk, Engine
from strata.stage_worker.kv_pool import KVPool
from strata.stage_worker.loader import LoadProgress, load_stage

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU lease)")

PROMPT = (1, 17, 200, 3, 45, 99, 12, 7, 250, 31, 64, 128)
STEPS = 12


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_test_model(tmp_path_factory.mktemp("gpu") / "llama.gguf", architecture="llama", block_count=4).path


def engine(path: Path, span: tuple[int, int], device: torch.device) -> Engine:
    source = open_source(str(path))
    try:
        header = read_header(source)
        model = load_stage(
            source=source, header=header, layer_start=span[0], layer_end=span[1], dtype=torch.float32,
            device=device, progress=LoadProgress(),
        )  # fmt: skip
    finally:
        source.close()
    c = model.config
    pool = KVPool(
        n_layers=span[1] - span[0], context=128, parallel=2, key_width=c.kv_dim, value_width=c.kv_dim,
        type_k=CacheType.F32, type_v=CacheType.F32, dtype=torch.float32, device=device,
    )  # fmt: skip
    return Engine(model=model, pool=pool, device=device, dtype=torch.float32)


def greedy(stages: list[Engine]) -> list[int]:
    """Prefill PROMPT, then STEPS greedy decode steps (the captured path on GPUs), through the stages in turn."""
    tokens: list[int] = []
    chunk = Chunk(slot=0, start_position=0, length=len(PROMPT), token_ids=PROMPT, sample=True)
    for _ in range(STEPS + 1):
        hidden = None
        for stage in stages:
            result = stage.step([chunk], hidden)
            hidden = None if result.hidden is None else result.hidden.to(stages[-1].device)
        token = result.tokens[0].token_id
        tokens.append(token)
        chunk = Chunk(slot=0, start_position=chunk.start_position + chunk.length, length=1, token_ids=(token,),
                      sample=True)  # fmt: skip
    for stage in stages:
        stage.pool.reset(0)
    return tokens


def test_a_stage_driven_from_a_fresh_thread_matches_the_main_thread(model_path: Path) -> None:
    stage = engine(model_path, (0, 4), torch.device("cuda:0"))
    stage.warm_up()
    expected = greedy([stage])
    found: list[list[int]] = []
    errors: list[BaseException] = []

    def run() -> None:  # a new thread has never set its current device
        try:
            found.append(greedy([stage]))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=300)
    assert not errors, errors
    assert found == [expected]


def test_a_cpu_stage_beside_a_gpu_stage_writes_the_all_gpu_text(model_path: Path) -> None:
    gpu = torch.device("cuda:0")
    all_gpu = greedy([engine(model_path, (0, 2), gpu), engine(model_path, (2, 4), gpu)])
    mixed = greedy([engine(model_path, (0, 2), torch.device("cpu")), engine(model_path, (2, 4), gpu)])
    assert mixed == all_gpu


def test_capture_and_every_allocation_name_the_stages_device(model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last GPU (cuda:0 on one): the graph is captured with that device current, on a stream of that device that
    the stage made (torch.cuda.graph's default capture stream is one per process, on whichever device captured first),
    and every tensor the stage holds lives there."""
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    stage = engine(model_path, (0, 4), device)
    captures: list[tuple[int, torch.device | None]] = []  # (current device, capture stream's device) per capture
    real_graph = torch.cuda.graph

    def recording_graph(*args: object, **kwargs: object) -> object:
        stream = kwargs.get("stream")
        captures.append((torch.cuda.current_device(), stream.device if isinstance(stream, torch.cuda.Stream) else None))
        return real_graph(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.cuda, "graph", recording_graph)
    stage.warm_up()
    greedy([stage])
    assert captures, "the decode step was captured"
    assert set(captures) == {(device.index, device)}, captures
    d = stage.decoder
    tensors = [*stage.model.parameters(), *stage.model.buffers(), stage.pool.table, stage.rope.inv_freq]
    tensors += [d.inputs, d.hidden, d._rows]
    tensors += [t for layer in stage.pool.layers for t in (layer.keys.values, layer.values.values)]
    outputs = [t for captured in d._captured.values() for t in (captured.output.logits, captured.output.greedy)]
    tensors += [t for t in outputs if t is not None]
    assert {t.device for t in tensors} == {device}
