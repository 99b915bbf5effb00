"""`strata serve [MODEL]`: the whole thing on one machine — stage workers as local processes, the gateway in front.

The layers are split evenly over `--stages` stage workers (the cluster planner's search is for GPU pools; one machine
has nothing to choose between) and fitted to the device's free memory by the planner's rules: the largest context that
fits with a q8_0 KV cache unless `--cache-type` says otherwise, or a refusal saying what is missing
(strata.gateway.local_plan). A model whose architecture the stages do not run is refused before any starts, with the
reason `strata inspect` shows. Each stage is started by `strata stage-worker` with the STRATA_* environment the
operator would give a stage pod, on loopback; consecutive stages on one device share one process (each on a port of
its own), where the activations pass in memory and the device keeps one context, unless `--process-per-stage`. The
gateway runs in this process with a fixed fencing token and prints
its endpoint, then "ready" once every stage has loaded. Ctrl-C (or SIGTERM) stops the gateway and every stage, and the
stages die with this process even when it is killed outright. Without MODEL it generates a small demo model (random
weights, a real tokenizer and chat template): the output is gibberish, but every part of the path is the real one.

Failures end serve with exit status 1 and a message, in two ways. A stage that reports a failed load (a file cut
short, memory that runs out, a decode step that runs on no path) stops serve at once with that stage's error: a
restart would fail the same way (strata.gateway.serve_watch). A stage process that dies is started again, with all
its stages, on its ports after a backoff and claimed under a new coordinator term, as a StatefulSet would bring a
stage pod back, and watched while it loads again; one that keeps dying ends serve with the end of its log
(strata.gateway.supervision).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import socket
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from strata.fit import DEFAULT_CACHE_TYPE
from strata.gateway import serve_speculation
from strata.gateway.serve_lines import say
from strata.gateway.settings import DEFAULT_MICRO_BATCHES, DEFAULT_PREFILL_CHUNK, prefill_chunk_refusal
from strata.gateway.supervision import RestartPolicy
from strata.gguf.model import UBATCH_TOKENS, CacheType
from strata.quantity import quantity_to_bytes

if TYPE_CHECKING:
    from fastapi import FastAPI
    from strata.gateway.local import StageProcess
    from strata.gateway.pipelines import Pipelines
    from strata.gateway.serve_watch import ServeWatch
    from strata.gateway.supervision import StageSupervisor

DEMO_LAYERS = 4
DEFAULT_PREFIX_CACHE_BYTES = 256 << 20  # per stage: a 2,000-token prompt of an 8B-class model in f16 is ~260 MB
DEFAULT_LOAD_TIMEOUT_S = 1800.0  # a 140 GB model read over HTTP at 100 MB/s takes about 1,400 s
EXIT_STAGE_FAILED = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a GGUF model on this machine: local stage workers behind the OpenAI-compatible gateway",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", nargs="?", default="", help="GGUF path or URL; omitted: a generated demo model")
    parser.add_argument("--stages", type=int, default=1, help="pipeline stages (default 1)")
    parser.add_argument(
        "--process-per-stage",
        action="store_true",
        help="start every stage as a process of its own; by default consecutive stages on one device share one, "
        "and their activations pass in memory",
    )
    parser.add_argument("--parallel", type=int, default=4, help="lanes: requests generating at once (default 4)")
    parser.add_argument(
        "--context", type=int, default=0, help="KV cells the lanes share (default: the most that fit, up to 4096)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port; 0 picks a free one (default 8000)")
    parser.add_argument("--model-name", default="", help="the id clients use (default: the file's general.name)")
    parser.add_argument("--queue-per-lane", type=int, default=1, help="waiting requests per lane (default 1)")
    parser.add_argument("--max-wait-seconds", type=float, default=10.0, help="longest wait for a lane (default 10)")
    parser.add_argument("--retry-after-seconds", type=int, default=1, help="Retry-After on 429 (default 1)")
    parser.add_argument(
        "--cache-type",
        default=DEFAULT_CACHE_TYPE.value,
        choices=[t.value for t in CacheType],
        help=f"KV cache type of the stages (default {DEFAULT_CACHE_TYPE.value}, as the operator plans)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="torch device of every stage: cpu, cuda:N, or cuda to deal stage i to GPU i mod the GPU count "
        "(default cpu)",
    )
    parser.add_argument(
        "--devices",
        default="",
        help="one device per stage, comma-separated (e.g. cuda:0,cuda:1,cpu): a CPU stage may sit beside GPU stages",
    )
    parser.add_argument(
        "--prefix-cache-bytes",
        type=int,
        default=DEFAULT_PREFIX_CACHE_BYTES,
        help=f"bytes per stage for prefix snapshots; 0: no prefix cache (default {DEFAULT_PREFIX_CACHE_BYTES})",
    )
    parser.add_argument(
        "--kv-host-memory",
        default="0",
        metavar="QUANTITY",
        help="host memory per stage for prefix snapshots the device lets go of, restored from there on a hit instead "
        "of computed again (e.g. 16Gi; default 0: none)",
    )
    parser.add_argument(
        "--resident-window",
        type=int,
        default=0,
        metavar="TOKENS",
        help="decode attends over this many positions a slot at most: the first 64, the last 1024 and blocks chosen "
        "between them; faster at depth, approximate past the window (default 0: every position, exact)",
    )
    parser.add_argument(
        "--prefix-cache-chunk", type=int, default=256, help="prefix snapshots are taken every N tokens (default 256)"
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=DEFAULT_PREFILL_CHUNK,
        metavar="TOKENS",
        help="a prompt goes in at most this many tokens a step, so decoding lanes keep stepping; 1 to the plan's "
        f"micro-batch of {UBATCH_TOKENS} (default {DEFAULT_PREFILL_CHUNK})",
    )
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=DEFAULT_MICRO_BATCHES,
        help="steps of disjoint lanes in flight at once, so two stages or more compute at the same time "
        f"(default {DEFAULT_MICRO_BATCHES}: one step at a time; a single stage always steps whole)",
    )
    serve_speculation.add_arguments(parser)
    parser.add_argument(
        "--load-timeout-seconds",
        type=float,
        default=DEFAULT_LOAD_TIMEOUT_S,
        help="give up when a stage has not loaded this long after its process started (stages that share a process "
        "load one after another) (default %(default)g)",
    )
    parser.add_argument("--api-keys-file", default="", help="accepted API keys, one per line (or STRATA_API_KEYS)")
    _add_supervision_options(parser)
    parser.set_defaults(run=run)


def _add_supervision_options(parser: argparse.ArgumentParser) -> None:
    defaults = RestartPolicy()
    parser.add_argument(
        "--stage-restarts",
        type=int,
        default=defaults.max_restarts,
        help="restarts of a dead stage allowed within --stage-restart-window; one more death ends serve with the "
        f"stage's log (default {defaults.max_restarts}; 0: end at the first death)",
    )
    parser.add_argument(
        "--stage-restart-window",
        type=float,
        default=defaults.window_s,
        help=f"seconds over which a stage's restarts are counted (default {defaults.window_s:g})",
    )


def run(args: argparse.Namespace) -> int:
    # Restarting a stage forks this process while gRPC's threads run, and gRPC's fork support (for children that go
    # on using gRPC; a stage worker execs at once) prints a warning at each fork. Read when grpc is first imported.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    import logging

    from strata.gateway.local import StageProcess, StageStartError
    from strata.gateway.local_plan import available_memory_bytes, plan_local, process_groups, stage_devices
    from strata.gateway.serve_watch import ServeWatch
    from strata.gateway.server import bind, build
    from strata.gateway.settings import GatewaySettings, api_keys
    from strata.gateway.speculation import DraftModelError
    from strata.gateway.supervision import StageSupervisor
    from strata.gguf import GGUFError, check_executable, describe, read_model_header
    from strata.kv_layout import ResidentBudget
    from strata.plan import GB

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        host_kv_bytes = quantity_to_bytes(args.kv_host_memory)
    except ValueError as exc:
        raise SystemExit(f"strata serve: --kv-host-memory {exc}") from exc
    try:
        if args.resident_window:
            ResidentBudget(tokens=args.resident_window).split()
    except ValueError as exc:
        raise SystemExit(f"strata serve: --resident-window {exc}") from exc
    if (chunk_refused := prefill_chunk_refusal(args.prefill_chunk)) is not None:
        raise SystemExit(f"strata serve: --prefill-chunk: {chunk_refused}")
    policy = _restart_policy(args)
    workdir = Path(tempfile.mkdtemp(prefix="strata-serve-"))
    model = args.model or str(_demo_model(workdir))
    try:
        header, size = read_model_header(model)
        info = describe(header, file_bytes=size)
        check_executable(
            info.architecture, unsupported=info.unsupported
        )  # the check `strata inspect` shows and the operator makes
        refused = serve_speculation.refusal(args, target=header, target_url=model)
        if refused is not None:
            raise ValueError(refused)
        if args.devices and args.device != "cpu":
            raise ValueError("give --device or --devices, not both")
        stages_on = stage_devices(
            device=args.device, devices=args.devices, stages=args.stages, gpu_count=_gpu_count(args)
        )
        local = plan_local(
            model=info,
            devices=stages_on,
            parallel=args.parallel,
            cache_type=CacheType(args.cache_type),
            available={device: available_memory_bytes(device) for device in set(stages_on)},
            context=args.context,
            resident=bool(args.resident_window),
        )
    except (GGUFError, ValueError) as exc:  # unreadable, not executable, more stages than layers, or it does not fit
        raise SystemExit(f"strata serve: {exc}") from exc
    spans, context = local.spans, local.context
    for use in local.uses:
        held = (
            f"{use.weight_bytes / GB:.2f} GB of weights and {use.kv_bytes / GB:.2f} GB of resident KV "
            f"({args.cache_type}), {host_kv_bytes * len(use.stages) / GB:.2f} GB of host KV"
        )
        room = "memory unknown, not checked" if use.usable_bytes is None else f"{use.usable_bytes / GB:.1f} GB usable"
        say(f"plan: {use.device} (stages {', '.join(map(str, use.stages))}): {held}; {room}")
    drafting = serve_speculation.draft_report(args, context=context, slots=args.parallel)
    if drafting is not None:
        say(drafting)
    watch = ServeWatch(load_timeout_s=args.load_timeout_seconds)
    watch.start()
    stages: list[StageProcess] = []
    envs: list[dict[str, str]] = []
    groups = process_groups(local.devices, process_per_stage=args.process_per_stage)
    try:
        next_stage = ""
        for group in reversed(groups):
            first, last = group[0], group[-1]
            env = {
                "STRATA_STAGE_INDEX": str(first),
                "STRATA_LAYER_START": str(spans[first][0]),
                "STRATA_LAYER_END": str(spans[last][1]),
                "STRATA_SPLIT_AT": ",".join(str(spans[index][0]) for index in group[1:]),
                "STRATA_MODEL_URL": model,
                "STRATA_CONTEXT": str(context),
                "STRATA_PARALLEL": str(args.parallel),
                "STRATA_CACHE_TYPE_K": args.cache_type,
                "STRATA_CACHE_TYPE_V": args.cache_type,
                "STRATA_NEXT_STAGE": next_stage,
                "STRATA_LISTEN": "127.0.0.1:0",
                "STRATA_DEVICE": local.devices[first],
                "STRATA_PREFIX_CACHE_BYTES": str(args.prefix_cache_bytes),
                "STRATA_KV_HOST_BYTES": str(host_kv_bytes),
                "STRATA_RESIDENT_TOKENS": str(args.resident_window),
            }
            log_name = f"stage-{first}.log" if len(group) == 1 else f"stages-{first}-{last}.log"
            try:
                stage = StageProcess(env=env, log_path=workdir / log_name, cancel=watch.failed)
            except StageStartError as exc:
                if watch.failed.is_set():  # cancelled: a stage started before failed, and the watch said so
                    return EXIT_STAGE_FAILED
                raise SystemExit(f"strata serve: {'stage' if len(group) == 1 else 'stages'} {first}: {exc}") from exc
            stages.insert(0, stage)
            envs.insert(0, env)
            next_stage = f"127.0.0.1:{stage.port}"
            if len(group) > 1:
                named = ", ".join(map(str, group[:-1])) + f" and {last}"
                say(f"stages {named} share one process on {local.devices[first]}: activations pass in memory")
            for index, port in zip(group, stage.ports, strict=True):
                start, end = spans[index]
                watch.add(index=index, address=f"127.0.0.1:{port}")
                say(f"stage {index}: layers [{start}, {end}) on {local.devices[index]} at 127.0.0.1:{port}")
        settings = GatewaySettings(
            model_url=model,
            model_name=args.model_name,
            first_stage=next_stage,
            context=context,
            parallel=args.parallel,
            queue_per_lane=args.queue_per_lane,
            max_wait_seconds=args.max_wait_seconds,
            retry_after_seconds=args.retry_after_seconds,
            listen=f"{args.host}:{args.port}",
            prefix_cache_chunk=args.prefix_cache_chunk if args.prefix_cache_bytes > 0 else 0,
            prefill_chunk=args.prefill_chunk,
            kv_cache_types=f"{args.cache_type}/{args.cache_type}",
            micro_batches=args.micro_batches,
            speculative=args.speculative,
            max_draft=args.max_draft,
            min_draft=args.min_draft,
            draft_model=args.draft,
            draft_device=args.draft_device,
            p_min=args.p_min,
            position_cost=args.position_cost,
            api_keys=api_keys(environ=os.environ, keys_file=args.api_keys_file),
        )
        try:
            app, serving = build(settings, header=header)
        except DraftModelError as exc:  # its weights failed to load: the header was checked before the stages
            raise SystemExit(f"strata serve: {exc}") from exc
        sock = bind(settings.listen)
        host, port = sock.getsockname()[:2]
        base = f"http://{host}:{port}/v1"
        say(f"serving {serving.model_name!r} ({len(spans)} stages, {args.parallel} lanes, context {context})")
        say(f"endpoint {base}  (stage logs in {workdir})")
        pipeline = serving.pipelines
        watch.all_started(pipeline_ready=lambda: None if pipeline.ready else pipeline.not_ready_reason)
        supervisor = StageSupervisor(stages, start=_restarter(stages, envs), policy=policy, report=say)
        _serve_supervised(app, sock, pipeline=pipeline, supervisor=supervisor, watch=watch)
    except KeyboardInterrupt:  # Ctrl-C before the server took over the signal: stop as it would
        return EXIT_INTERRUPTED
    finally:
        watch.close()
        for stage in stages:
            stage.stop()
    return EXIT_STAGE_FAILED if watch.failed.is_set() else 0


def _gpu_count(args: argparse.Namespace) -> int:
    if "cuda" not in args.device + args.devices:
        return 0
    import torch

    return torch.cuda.device_count()


def _restart_policy(args: argparse.Namespace) -> RestartPolicy:
    try:
        return RestartPolicy(max_restarts=args.stage_restarts, window_s=args.stage_restart_window)
    except ValueError as exc:
        raise SystemExit(f"strata serve: {exc}") from exc


def _restarter(
    stages: list[StageProcess], envs: list[dict[str, str]]
) -> Callable[[int, threading.Event], StageProcess]:
    """Starts stage process `index` again as it was first started, on the ports it had: the previous stage (or the
    gateway) still points there. Its log goes on in the same file."""
    from strata.gateway.local import StageProcess

    ports = [stage.ports for stage in stages]

    def start(index: int, cancel: threading.Event) -> StageProcess:
        env = {**envs[index], "STRATA_LISTEN": ",".join(f"127.0.0.1:{port}" for port in ports[index])}
        return StageProcess(env=env, log_path=stages[index].log_path, cancel=cancel)

    return start


def _serve_supervised(
    app: FastAPI,
    sock: socket.socket,
    *,
    pipeline: Pipelines,
    supervisor: StageSupervisor[StageProcess],
    watch: ServeWatch,
) -> None:
    """Serve HTTP until Ctrl-C, SIGTERM or a failure, with the supervisor watching the stages' processes and `watch`
    their loading.

    A stage found dead makes the coordinator take the next term at once: readiness drops, what was running fails
    with a retryable 503, and the driver claims every stage under the new term once the stage is back and loaded, so
    no stage keeps slots or prefix snapshots of the old run; the watch follows its new load. A stage given up on, or
    one that fails to load, is reported through the watch, which then shuts the server down as SIGTERM would. The
    callbacks come from the supervisor's and the watch's threads, so they hop onto the event loop.
    """
    from strata.gateway.server import http_server

    server = http_server(app)

    async def run() -> None:
        loop = asyncio.get_running_loop()

        def on_loop(callback: Callable[[], None]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: serve is on its way out anyway
                loop.call_soon_threadsafe(callback)

        def shut_down() -> None:
            server.should_exit = True

        def lost(index: int) -> None:
            for stage in supervisor.stages[index].stages:
                watch.restarted(stage)
            on_loop(lambda: _next_term(pipeline))

        watch.on_failure(lambda: on_loop(shut_down))
        supervisor.start(on_lost=lost, on_gave_up=lambda error: watch.fail(str(error)))
        try:
            await server.serve(sockets=[sock])
        finally:
            supervisor.stop()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down; that is the normal way out
        pass
    finally:
        supervisor.stop()


def _next_term(pipeline: Pipelines) -> None:
    """Move the coordinator to the next term, as a won election would: it claims every stage again before serving."""
    fence = pipeline.fence
    if fence is not None:
        pipeline.promote(dataclasses.replace(fence, term=fence.term + 1))


def _demo_model(folder: Path) -> Path:
    from strata.gguf.testmodels import write_test_model

    path = folder / "strata-demo.gguf"
    write_test_model(path, architecture="qwen2", block_count=DEMO_LAYERS)
    return path
