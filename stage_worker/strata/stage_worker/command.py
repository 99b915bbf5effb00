"""`strata stage-worker`: run one pipeline stage, or several consecutive ones that share a device, until SIGTERM.

The operator configures a stage pod through these environment variables; each also has a flag, and a flag given on
the command line wins over the environment.

    STRATA_STAGE_INDEX       position of this stage in the pipeline (0 is first)
    STRATA_LAYER_START       first layer this stage holds (this process's stages, with STRATA_SPLIT_AT)
    STRATA_LAYER_END         one past the last layer this stage holds (this process's stages, with STRATA_SPLIT_AT)
    STRATA_SPLIT_AT          layers where this process's span divides into stages of their own, comma-separated
                             (default empty: one stage). Stage i+1 of the process is stage STRATA_STAGE_INDEX + i + 1,
                             on a port of its own; it takes the activations of the stage before it as the tensor
                             itself, in memory. For stages that share a device: `strata serve` groups them so.
    STRATA_MODEL_URL         GGUF file: a local path, file://, or http(s):// (read with Range requests)
    STRATA_CONTEXT           KV cells in the unified pool shared by the slots
    STRATA_PARALLEL          slots (lanes) sharing the pool
    STRATA_CACHE_TYPE_K      K cache type: f32, f16, bf16 or q8_0 (default q8_0)
    STRATA_CACHE_TYPE_V      V cache type: f32, f16, bf16 or q8_0 (default q8_0)
    STRATA_NEXT_STAGE        host:port of the stage after this process's stages; empty on the last stage
    STRATA_LISTEN            address to serve gRPC on (default 0.0.0.0:50051); with STRATA_SPLIT_AT one address
                             per stage, comma-separated, or one with port 0 for all
    STRATA_DEVICE            torch device: cpu, cuda, cuda:N (default cpu)
    STRATA_DTYPE             compute dtype: float32, float16, bfloat16 (default float32 on CPU, bfloat16 on GPUs)
    STRATA_PLAN_GENERATION   the plan generation this stage belongs to (default 0)
    STRATA_PREFIX_CACHE_BYTES  device bytes for prefix snapshots, reserved by the plan (default 0: keep none)
    STRATA_KV_HOST_BYTES     host bytes for the snapshots the device lets go of, restored from there on a hit
                             instead of computed again (default 0: keep none)
    STRATA_PIPELINE_CHUNK    the first stage sends a longer prefill on in pieces of this many positions, so the
                             next stage starts on it at once (default 512; 0 sends each step whole). A prefill
                             that stays in this process goes whole: its stages share a device, nothing overlaps
    STRATA_HOP_SLOTS         slots of the shared-memory ring through which a previous stage on this host sends
                             activations (default 4; 0: always over gRPC)
    STRATA_HOP_SLOT_POSITIONS  positions one slot holds; a larger step comes over gRPC (default 1024)
    STRATA_RESIDENT_TOKENS   decode attends over a resident window of this many positions a slot: the first
                             STRATA_RESIDENT_SINK_TOKENS (default 64), the last STRATA_RESIDENT_RECENT_TOKENS (default
                             1024) and blocks chosen between them by their keys' bound against the last query; an
                             approximation of attention past the window (default 0: every position, exact)

torch is imported only when the command runs, so `strata --help` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from strata.settings import Option, add_options, resolve_options

STOP_GRACE_S = 5.0  # an open stream's time to end after SIGTERM, before it is cancelled
STOP_DEADLINE_S = 20.0  # every stage's stop and every thread's end after SIGTERM; past it the process says what held it

# Flag, environment variable, type, default (None: required).
OPTIONS: tuple[Option, ...] = tuple(
    Option(*row)
    for row in (
        ("--stage-index", "STRATA_STAGE_INDEX", int, 0),
        ("--layer-start", "STRATA_LAYER_START", int, None),
        ("--layer-end", "STRATA_LAYER_END", int, None),
        ("--model-url", "STRATA_MODEL_URL", str, None),
        ("--context", "STRATA_CONTEXT", int, None),
        ("--parallel", "STRATA_PARALLEL", int, 4),
        ("--cache-type-k", "STRATA_CACHE_TYPE_K", str, "q8_0"),
        ("--cache-type-v", "STRATA_CACHE_TYPE_V", str, "q8_0"),
        ("--next-stage", "STRATA_NEXT_STAGE", str, ""),
        ("--listen", "STRATA_LISTEN", str, "0.0.0.0:50051"),
        ("--device", "STRATA_DEVICE", str, "cpu"),
        ("--dtype", "STRATA_DTYPE", str, ""),
        ("--plan-generation", "STRATA_PLAN_GENERATION", int, 0),
        ("--prefix-cache-bytes", "STRATA_PREFIX_CACHE_BYTES", int, 0),
        ("--kv-host-bytes", "STRATA_KV_HOST_BYTES", int, 0),
        ("--pipeline-chunk", "STRATA_PIPELINE_CHUNK", int, 512),
        ("--hop-slots", "STRATA_HOP_SLOTS", int, 4),
        ("--hop-slot-positions", "STRATA_HOP_SLOT_POSITIONS", int, 1024),
        ("--split-at", "STRATA_SPLIT_AT", str, ""),
        ("--resident-tokens", "STRATA_RESIDENT_TOKENS", int, 0),
        ("--resident-sink-tokens", "STRATA_RESIDENT_SINK_TOKENS", int, 64),
        ("--resident-recent-tokens", "STRATA_RESIDENT_RECENT_TOKENS", int, 1024),
    )
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "stage-worker",
        help="serve one pipeline stage (a span of layers), or several that share a device, over gRPC",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(parser, OPTIONS)
    parser.set_defaults(run=run)


def resolve(args: argparse.Namespace, environ: dict[str, str]) -> dict[str, object]:
    return resolve_options(OPTIONS, vars(args), environ, command="stage-worker")


def run(args: argparse.Namespace) -> int:
    from strata.gguf.model import CacheType
    from strata.stage_worker.co_located import CoLocatedStages, co_located_settings, parse_split
    from strata.stage_worker.settings import StageSettings
    from strata.stage_worker.shutdown import stop_within

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    values = resolve(args, dict(os.environ))
    try:
        split_at = parse_split(str(values.pop("split_at")))
        values["cache_type_k"] = CacheType(str(values["cache_type_k"]))
        values["cache_type_v"] = CacheType(str(values["cache_type_v"]))
        settings = co_located_settings(StageSettings(**values), split_at=split_at)  # type: ignore[arg-type]
    except ValueError as exc:
        raise SystemExit(f"strata stage-worker: {exc}") from exc
    group = CoLocatedStages(settings)
    for each, stage in zip(settings, group.stages, strict=True):
        print(f"stage {each.stage_index} listening on port {stage.port}", flush=True)
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    stopping.wait()
    stop_within(lambda: group.stop(grace_s=STOP_GRACE_S), deadline_s=STOP_DEADLINE_S, what="strata stage-worker")
    return 0
