"""The layer slices compute what HF transformers computes from the same GGUF file, one process, no gRPC."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from strata.gguf.model import CacheType
from strata.stage_worker.engine import Chunk, Engine
from strata.stage_worker.kv_pool import KVPool
from strata_testbed.hf_reference import hf_reference
from strata_testbed.stages import load_spans

CPU = torch.device("cpu")
PROMPT = (1, 17, 200, 3, 45, 99, 12, 7, 250, 31, 64, 128, 5, 77, 190, 2, 33, 81, 140, 9)


def engines(path: Path, spans: list[tuple[int, int]], cache_type: CacheType = CacheType.F32) -> list[Engine]:
    built = []
    for (start, end), model in zip(spans, load_spans(path, spans), strict=True):
        c = model.config
        pool = KVPool(
            n_layers=end - start,
            context=64,
            parallel=2,
            key_width=c.kv_dim,
            value_width=c.kv_dim,
            type_k=cache_type,
            type_v=cache_type,
            dtype=torch.float32,
            device=CPU,
        )
        built.append(Engine(model=model, pool=pool, device=CPU, dtype=torch.float32))
    return built


def run_chunks(stages: list[Engine], chunks: list[Chunk]) -> dict[int, torch.Tensor]:
    hidden = None
    for engine in stages:
        result = engine.step(chunks, hidden)
        hidden = result.hidden
    return result.logits


@pytest.mark.parametrize("architecture", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize(
    "spans",
    [
        pytest.param([(0, 3)], id="one stage holds every layer"),
        pytest.param([(0, 1), (1, 2), (2, 3)], id="three stages hold one layer each"),
    ],
)
def test_prompt_logits_match_hf_with_chunked_prefill_and_two_slots(
    tiny_models: dict[str, Path], architecture: str, spans: list[tuple[int, int]]
) -> None:
    stages = engines(tiny_models[architecture], spans)
    other = PROMPT[::-1]
    first = run_chunks(
        stages,
        [
            Chunk(slot=0, start_position=0, length=7, token_ids=PROMPT[:7], return_logits=True),
            Chunk(slot=1, start_position=0, length=20, token_ids=other, return_logits=True),
        ],
    )
    second = run_chunks(stages, [Chunk(slot=0, start_position=7, length=13, token_ids=PROMPT[7:], return_logits=True)])
    ours = {0: torch.cat([first[0], second[0]]), 1: first[1]}
    reference = hf_reference(tiny_models[architecture])
    with torch.inference_mode():
        for slot, prompt in ((0, PROMPT), (1, other)):
            expected = reference(torch.tensor([prompt])).logits[0]
            relative = (ours[slot] - expected).norm(dim=-1) / expected.norm(dim=-1)
            assert float(relative.max()) <= 1e-4


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
def test_batched_decode_steps_pick_what_hf_picks_for_every_slot(
    tiny_models: dict[str, Path], architecture: str
) -> None:
    """Decode-only steps take the batched path (a CUDA graph on GPUs); greedy picks and log-probs match HF's."""
    stages = engines(tiny_models[architecture], [(0, 2), (2, 3)])
    sequences = {0: list(PROMPT[:5]), 1: list(PROMPT[::-1][:11])}
    # Prefill all but the last token; each decode step then feeds a slot's last token and samples the next.
    run_chunks(
        stages,
        [Chunk(slot=s, start_position=0, length=len(q) - 1, token_ids=tuple(q[:-1])) for s, q in sequences.items()],
    )
    reference = hf_reference(tiny_models[architecture])
    for _ in range(4):
        chunks = [
            Chunk(slot=s, start_position=len(q) - 1, length=1, token_ids=(q[-1],), sample=True)
            for s, q in sequences.items()
        ]
        hidden = None
        for engine in stages:
            result = engine.step(chunks, hidden)
            hidden = result.hidden
        with torch.inference_mode():
            for slot, sequence in sequences.items():
                expected = torch.log_softmax(reference(torch.tensor([sequence])).logits[0, -1], dim=-1)
                picked = result.tokens[slot]
                assert picked.token_id == int(torch.argmax(expected))
                assert abs(picked.logprob - float(expected[picked.token_id])) <= 1e-4
                sequence.append(picked.token_id)
