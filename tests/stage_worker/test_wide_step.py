"""A step that verifies drafts runs as a decode step of a few rows a slot (strata.stage_worker.wide_step): its rows
and fillers, and, on the engines of a real generated model, the same picks, the same later steps and the same free
cells as the same step run eagerly. Log-probabilities agree to float32 rounding: the wide step multiplies more rows
(its fillers), and a matrix product's rounding follows its shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from strata.gguf.model import CacheType
from strata.stage_worker import engine as engine_module
from strata.stage_worker.decode import WIDEST, Decoder
from strata.stage_worker.engine import Chunk, Engine, StepResult
from strata.stage_worker.sampling import Sampling
from strata.stage_worker.wide_step import widen
from strata_testbed.stages import cpu_engines, through

CPU = torch.device("cpu")
PROMPT = (1, 17, 200, 3, 45, 99, 12, 7)


def _drafting(slot: int, start: int, tokens: tuple[int, ...], **fields: object) -> Chunk:
    return Chunk(slot, start, len(tokens), tokens, sample=True, drafted=len(tokens) - 1, **fields)  # type: ignore[arg-type]


@dataclass(frozen=True)
class LayoutCase:
    name: str
    chunks: tuple[Chunk, ...]
    width: int | None  # None: not a wide step
    slots: list[int] | None = None
    positions: list[int] | None = None
    tokens: list[int] | None = None
    real: list[int] | None = None
    source: list[int] | None = None
    picks: list[list[int]] | None = None
    fillers: list[tuple[int, int]] | None = None


LAYOUTS = [
    LayoutCase(
        "one slot drafting two", (_drafting(3, 10, (5, 6, 7)),), 3,
        slots=[3, 3, 3], positions=[10, 11, 12], tokens=[5, 6, 7], real=[0, 1, 2], source=[0, 1, 2],
        picks=[[0, 1, 2]], fillers=[],
    ),
    LayoutCase(
        "a plain decode row beside a draft gets fillers", (_drafting(0, 4, (8,)), _drafting(1, 20, (5, 6, 7))), 3,
        slots=[0, 0, 0, 1, 1, 1], positions=[4, 5, 6, 20, 21, 22], tokens=[8, 8, 8, 5, 6, 7], real=[0, 3, 4, 5],
        source=[0, 0, 0, 1, 2, 3], picks=[[0], [3, 4, 5]], fillers=[(0, 5)],
    ),
    LayoutCase(
        "a row that does not sample picks nothing", (Chunk(2, 9, 1, (4,)), _drafting(0, 3, (1, 2))), 2,
        slots=[2, 2, 0, 0], positions=[9, 10, 3, 4], tokens=[4, 4, 1, 2], real=[0, 2, 3], source=[0, 0, 1, 2],
        picks=[[], [2, 3]], fillers=[(2, 10)],
    ),
    LayoutCase(
        "a few tokens fed after what the slot holds", (Chunk(1, 30, 3, (4, 5, 6), sample=True),), 3,
        slots=[1, 1, 1], positions=[30, 31, 32], tokens=[4, 5, 6], real=[0, 1, 2], source=[0, 1, 2], picks=[[2]],
        fillers=[],
    ),
    LayoutCase("plain decode rows only: the decode step", (_drafting(0, 4, (8,)), _drafting(1, 7, (9,))), None),
    LayoutCase("a prompt's chunk: prefill", (Chunk(0, 0, 3, (1, 2, 3), sample=True), _drafting(1, 7, (9, 8))), None),
    LayoutCase("logits asked for", (Chunk(0, 5, 2, (1, 2), sample=True, return_logits=True, drafted=1),), None),
    LayoutCase(f"over {WIDEST} positions", (_drafting(0, 5, tuple(range(WIDEST + 1))),), None),
]  # fmt: skip


@pytest.mark.parametrize("case", LAYOUTS, ids=lambda c: c.name)
def test_rows_fillers_and_picks_of_a_wide_step(case: LayoutCase) -> None:
    wide = widen(case.chunks)
    if case.width is None:
        assert wide is None
        return
    assert wide is not None
    assert (wide.width, wide.slots, wide.positions, wide.tokens) == (
        case.width,
        case.slots,
        case.positions,
        case.tokens,
    )
    assert (wide.real, wide.source, wide.picks, wide.fillers) == (case.real, case.source, case.picks, case.fillers)


def _engines(path: Path, case: EngineCase) -> list[Engine]:
    return cpu_engines(path, case.spans, cache_type=CacheType.Q8_0, context=case.context, parallel=3, block=4)


def _picks(result: StepResult) -> dict[int, list[tuple[int, float]]]:
    singles = {slot: [(s.token_id, s.logprob)] for slot, s in result.tokens.items()}
    return singles | {slot: [(s.token_id, s.logprob) for s in run] for slot, run in result.runs.items()}


@dataclass(frozen=True)
class EngineCase:
    name: str
    spans: list[tuple[int, int]]
    drafts: tuple[tuple[int, ...], ...]  # per slot, the tokens after its last pick this step (empty: plain decode)
    context: int = 64
    wide: bool = True  # whether the step runs as a wide decode step (False: its fillers do not fit the context)
    sampling: Sampling = field(default_factory=Sampling)


SEEDED = Sampling(temperature=1.0, seed=11)
ENGINE_CASES = [
    EngineCase("one slot drafting three", [(0, 3)], ((9, 9, 9),)),
    EngineCase("drafts of three lengths and a plain row", [(0, 3)], ((4, 5, 6), (7,), ())),
    EngineCase("sampled, seeded", [(0, 3)], ((4, 5, 6), ()), sampling=SEEDED),
    EngineCase("three stages", [(0, 1), (1, 2), (2, 3)], ((4, 5, 6), (), (7, 8))),
    EngineCase("fillers past the context: run eagerly", [(0, 3)], ((), (5, 6, 7)), context=10, wide=False),
]


def _play(stages: list[Engine], case: EngineCase) -> tuple[list[dict[int, list[tuple[int, float]]]], list[int]]:
    """Prompts in each slot, one step drafting `case.drafts` after each slot's first pick, then two plain decode
    steps from where each slot's accepted run ends: every step's picks, and the free cells of each stage after."""
    slots = range(len(case.drafts))
    prompts = [PROMPT[: 7 - 2 * slot] for slot in slots]
    first = through(stages, [Chunk(s, 0, len(prompts[s]), prompts[s], sample=True) for s in slots])
    last = {s: first.tokens[s].token_id for s in slots}
    at = {s: len(prompts[s]) for s in slots}
    seen = [_picks(first)]
    chunks = [
        Chunk(s, at[s], 1 + len(case.drafts[s]), (last[s], *case.drafts[s]), sample=True, sampling=case.sampling,
              drafted=len(case.drafts[s]))
        for s in slots
    ]  # fmt: skip
    step = through(stages, chunks)
    seen.append(_picks(step))
    for s, picks in seen[-1].items():
        at[s] += len(picks)
        last[s] = picks[-1][0]
    for _ in range(2):
        plain = through(stages, [Chunk(s, at[s], 1, (last[s],), sample=True) for s in slots])
        seen.append(_picks(plain))
        for s in slots:
            at[s], last[s] = at[s] + 1, plain.tokens[s].token_id
    return seen, [engine.pool.free_cells for engine in stages]


@pytest.mark.parametrize("case", ENGINE_CASES, ids=lambda c: c.name)
def test_a_wide_step_answers_as_the_same_step_run_eagerly(
    case: EngineCase, tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    widths: list[int] = []
    run = Decoder.run

    def counted(self: Decoder, **kwargs: object) -> object:
        widths.append(int(kwargs.get("width", 1)))  # type: ignore[call-overload]
        return run(self, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Decoder, "run", counted)
    wide = _play(
        cpu_engines(
            tiny_models["llama"], case.spans, cache_type=CacheType.Q8_0, context=case.context, parallel=3, block=4
        ),
        case,
    )
    ran_wide = any(width > 1 for width in widths)
    monkeypatch.setattr(engine_module, "widen", lambda chunks: None)
    eager = _play(
        cpu_engines(
            tiny_models["llama"], case.spans, cache_type=CacheType.Q8_0, context=case.context, parallel=3, block=4
        ),
        case,
    )
    (wide_picks, wide_free), (eager_picks, eager_free) = wide, eager
    assert wide_free == eager_free, "the fillers' cells are given back"
    assert [{s: [t for t, _ in p] for s, p in step.items()} for step in wide_picks] == [
        {s: [t for t, _ in p] for s, p in step.items()} for step in eager_picks
    ]
    logprobs = [lp for step in wide_picks for slot in sorted(step) for _, lp in step[slot]]
    assert logprobs == pytest.approx(
        [lp for step in eager_picks for slot in sorted(step) for _, lp in step[slot]], abs=1e-5
    )
    assert ran_wide == case.wide
