"""Decoding ahead (strata.stage_worker.decode_ahead) changes when the GPU works, never what a step answers.

Each case drives two engines on the same single-stage model through the same script of steps, one decoding ahead
(forced on here: by default it is on with CUDA graphs) and one not, and checks that every step's picks are equal
(the CPU runs the same body eagerly, so equal means bit for bit). The script's tokens are the engines' own greedy
picks unless a step says otherwise, as a coordinator's would be. Each case also counts the steps that the engine
ran itself, not taken from a step launched ahead, so a case whose steps all follow each other shows the launched
work was used.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from strata.gguf.model import CacheType
from strata.gguf.testmodels import write_test_model
from strata.stage_worker.decode import Decoder
from strata.stage_worker.decode_ahead import Ahead, rows_served
from strata.stage_worker.engine import Chunk, Engine
from strata.stage_worker.kv_pool import KVPool
from strata.stage_worker.model import StageModel
from strata.stage_worker.sampling import Sampling
from strata_testbed.stages import load_spans

PROMPTS = {0: (1, 17, 200, 3, 45, 99), 1: (7, 250, 31, 64), 2: (12, 5, 77)}
CONTEXT = 32


@dataclass(frozen=True)
class Move:
    """One step: which slots decode, or a slot's prompt, or an action between steps."""

    slots: tuple[int, ...] = ()  # slots that decode one position with their last pick
    prompt: int | None = None  # a slot (re)starting with its prompt (a prefill chunk)
    sampled: int | None = None  # a slot of `slots` that samples at temperature 1 this step
    rollback: int | None = None  # a slot of `slots` that steps back one position, fed its previous token again
    reset: int | None = None  # a slot reset before this step's chunks (a request cancelled)


@dataclass(frozen=True)
class Case:
    name: str
    moves: tuple[Move, ...]
    own_steps: int  # decode steps the engine deciding ahead runs itself, not taken from a step launched ahead


def _steady(slots: tuple[int, ...], steps: int) -> tuple[Move, ...]:
    return tuple(Move(prompt=s) for s in slots) + (Move(slots=slots),) * steps


CASES = [
    Case("one stream, twelve steps", _steady((0,), 12), own_steps=1),
    Case("two streams together", _steady((0, 1), 8), own_steps=1),
    Case("one of two streams ends", _steady((0, 1), 4) + (Move(slots=(1,)),) * 4, own_steps=1),
    Case("a stream samples one step", (*_steady((0,), 3), Move(slots=(0,), sampled=0), Move(slots=(0,))), own_steps=3),
    Case("a prompt joins", (*_steady((0,), 3), Move(prompt=1), Move(slots=(0, 1)), Move(slots=(0, 1))), own_steps=2),
    Case("a step rolls back", (*_steady((0,), 3), Move(slots=(0,), rollback=0), Move(slots=(0,))), own_steps=2),
    Case("a slot reset and started again", (*_steady((0,), 3), Move(reset=0, prompt=0), Move(slots=(0,))), own_steps=2),
    Case("steps to the end of the context", _steady((2,), CONTEXT - len(PROMPTS[2])), own_steps=1),
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_test_model(tmp_path_factory.mktemp("ahead") / "llama.gguf", architecture="llama", block_count=2).path


def _stage(path: Path, *, layers: int) -> tuple[StageModel, KVPool]:
    """Layers 0..layers-1 of the model on the CPU in f32, and a pool of CONTEXT cells for three slots."""
    (model,) = load_spans(path, [(0, layers)])
    c = model.config
    pool = KVPool(
        n_layers=layers, context=CONTEXT, parallel=3, key_width=c.kv_dim, value_width=c.kv_dim,
        type_k=CacheType.F32, type_v=CacheType.F32, dtype=torch.float32, device=torch.device("cpu"),
    )  # fmt: skip
    return model, pool


def _engine(path: Path, *, ahead: bool) -> Engine:
    model, pool = _stage(path, layers=2)
    return Engine(model=model, pool=pool, device=torch.device("cpu"), dtype=torch.float32, decode_ahead=ahead)


def _play(engine: Engine, moves: tuple[Move, ...]) -> Iterator[list[tuple[int, int, float]]]:
    """Each step's picks, (slot, token, log-probability), as the script unfolds with the engine's own picks."""
    length: dict[int, int] = {}
    last: dict[int, int] = {}
    previous: dict[int, int] = {}
    for move in moves:
        if move.reset is not None:
            engine.pool.reset(move.reset)
        chunks = []
        if move.prompt is not None:
            prompt = PROMPTS[move.prompt]
            chunks.append(Chunk(slot=move.prompt, start_position=0, length=len(prompt), token_ids=prompt, sample=True))
            length[move.prompt] = len(prompt)
        for slot in move.slots:
            if slot == move.prompt:
                continue
            if slot == move.rollback:
                length[slot] -= 1
                last[slot] = previous[slot]
            sampling = Sampling(temperature=1.0, seed=3) if slot == move.sampled else Sampling()
            chunks.append(Chunk(slot=slot, start_position=length[slot], length=1, token_ids=(last[slot],),
                                sample=True, sampling=sampling))  # fmt: skip
        result = engine.step(chunks, None)
        picks = []
        for chunk in chunks:
            pick = result.tokens[chunk.slot]
            previous[chunk.slot] = chunk.token_ids[-1]
            last[chunk.slot] = pick.token_id
            if chunk.length == 1:
                length[chunk.slot] += 1
            picks.append((chunk.slot, pick.token_id, pick.logprob))
        yield picks


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_decoding_ahead_answers_every_step_as_without(
    case: Case, model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = list(_play(_engine(model_path, ahead=False), case.moves))
    own = []
    run = Decoder.run

    def counted(self: Decoder, **kwargs: object) -> object:
        if kwargs.get("fed") is None:
            own.append(1)
        return run(self, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Decoder, "run", counted)
    ahead = _engine(model_path, ahead=True)
    got = list(_play(ahead, case.moves))
    assert got == expected
    assert len(own) == case.own_steps


def test_decoding_ahead_is_refused_where_it_cannot_work(model_path: Path) -> None:
    model, pool = _stage(model_path, layers=1)  # the first of two layers: no head
    with pytest.raises(ValueError, match="embedding and the head"):
        Engine(model=model, pool=pool, device=torch.device("cpu"), dtype=torch.float32, decode_ahead=True)


def _chunk(slot: int, position: int, token: int, **fields: object) -> Chunk:
    return Chunk(slot=slot, start_position=position, length=1, token_ids=(token,), sample=True, **fields)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ServedCase:
    name: str
    chunks: tuple[Chunk, ...]
    rows: list[int] | None
    changed: int | None = None  # a slot reset or restored since the step was launched


LAUNCHED = Ahead(slots=(4, 9), positions=(10, 3), tokens=(50, 60), picks=None, revisions=(7, 2))  # type: ignore[arg-type]
SERVED_CASES = [
    ServedCase("both slots", (_chunk(4, 10, 50), _chunk(9, 3, 60)), [0, 1]),
    ServedCase("one slot left out", (_chunk(9, 3, 60),), [1]),
    ServedCase("the other order", (_chunk(9, 3, 60), _chunk(4, 10, 50)), [1, 0]),
    ServedCase("another slot", (_chunk(4, 10, 50), _chunk(5, 0, 60)), None),
    ServedCase("another position", (_chunk(4, 9, 50),), None),
    ServedCase("another token", (_chunk(4, 10, 51),), None),
    ServedCase("sampled", (_chunk(4, 10, 50, sampling=Sampling(temperature=0.7)),), None),
    ServedCase("log-probabilities asked", (_chunk(4, 10, 50, sampling=Sampling(logprobs=2)),), None),
    ServedCase(
        "a draft to verify",
        (Chunk(slot=4, start_position=10, length=2, token_ids=(50, 8), sample=True, drafted=1),),
        None,
    ),
    ServedCase("its slot reset or restored since", (_chunk(4, 10, 50),), None, changed=4),
    ServedCase("a slot left out changed since", (_chunk(4, 10, 50),), [0], changed=9),
]


@pytest.mark.parametrize("case", SERVED_CASES, ids=lambda c: c.name)
def test_a_step_is_taken_from_the_one_launched_ahead_only_when_it_asks_the_same(case: ServedCase) -> None:
    revisions = [0] * 10
    revisions[4], revisions[9] = LAUNCHED.revisions
    if case.changed is not None:
        revisions[case.changed] += 1
    assert rows_served(LAUNCHED, list(case.chunks), revisions=revisions) == case.rows


def test_positions_taken_ahead_are_given_back_when_the_next_step_does_not_take_them(model_path: Path) -> None:
    """A full pool must not refuse a prompt for cells a guess holds: after a step that does not take the launched
    work (a prompt joins), and after one that leaves a slot out, each slot holds what the coordinator counts."""
    engine = _engine(model_path, ahead=True)
    steps = list(_play(engine, (*_steady((0, 1), 3), Move(slots=(0,)))))
    held = {0: len(PROMPTS[0]) + 4, 1: len(PROMPTS[1]) + 3}  # 3 steps of both, then one of slot 0 alone
    assert [len(step) for step in steps] == [1, 1, 2, 2, 2, 1]
    assert {slot: engine.pool.length(slot) for slot in (0, 1)} == {0: held[0] + 1, 1: held[1]}
    prompt = PROMPTS[2]
    engine.step([Chunk(slot=2, start_position=0, length=len(prompt), token_ids=prompt, sample=True)], None)
    assert {slot: engine.pool.length(slot) for slot in (0, 1)} == held
