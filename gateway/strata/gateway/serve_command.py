"""`strata serve [MODEL]`: the whole thing on one machine — stage workers as local processes, the gateway in front.

The layers are split evenly over `--stages` stage workers (the cluster planner's search is for GPU pools; one machine
has nothing to choose between) and fitted to the device's free memory by the planner's rules: the largest context that
fits with a q8_0 KV cache unless `--cache-type` says otherwise, or a refusal saying what is missing
(strata.gateway.local_plan). A model whose architecture the stages do not run is refused before any starts, with the
reason `strata inspect` shows. Each stage is started as `strata stage-worker` with the STRATA_* environment the
operator would give a stage pod, on loopback. The gateway runs in this process with a fixed fencing token and prints
its endpoint, then "ready" once every stage has loaded; a stage that fails to load stops serve at once with that
stage's error and exit status 1 (strata.gateway.serve_watch). Ctrl-C (or SIGTERM) stops the gateway and every stage,
and the stages die with this process even when it is killed outright. Without MODEL it generates a small demo model
(random weights, a real tokenizer and chat template): the output is gibberish, but every part of the path is the real
one.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from strata.fit import DEFAULT_CACHE_TYPE
from strata.gateway.settings import DEFAULT_MICRO_BATCHES
from strata.gguf.model import CacheType

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
    parser.add_argument("--stages", type=int, default=1, help="stage worker processes (default 1)")
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
    parser.add_argument("--device", default="cpu", help="torch device of the stages (default cpu)")
    parser.add_argument(
        "--prefix-cache-bytes",
        type=int,
        default=DEFAULT_PREFIX_CACHE_BYTES,
        help=f"bytes per stage for prefix snapshots; 0: no prefix cache (default {DEFAULT_PREFIX_CACHE_BYTES})",
    )
    parser.add_argument(
        "--prefix-cache-chunk", type=int, default=256, help="prefix snapshots are taken every N tokens (default 256)"
    )
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=DEFAULT_MICRO_BATCHES,
        help="steps of disjoint lanes in flight at once, so two stages or more compute at the same time "
        f"(default {DEFAULT_MICRO_BATCHES}: one step at a time; a single stage always steps whole)",
    )
    parser.add_argument(
        "--load-timeout-seconds",
        type=float,
        default=DEFAULT_LOAD_TIMEOUT_S,
        help="give up when the stages have not loaded in this time (default %(default)g)",
    )
    parser.add_argument("--api-keys-file", default="", help="accepted API keys, one per line (or STRATA_API_KEYS)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import logging

    from strata.gateway.local import StageProcess, StageStartError
    from strata.gateway.local_plan import available_memory_bytes, plan_local
    from strata.gateway.serve_watch import ServeWatch
    from strata.gateway.server import bind, build, serve
    from strata.gateway.settings import GatewaySettings, api_keys
    from strata.gguf import GGUFError, check_executable, describe, read_model_header
    from strata.plan import GB
    from strata.stage_loading import WatchedStage

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    workdir = Path(tempfile.mkdtemp(prefix="strata-serve-"))
    model = args.model or str(_demo_model(workdir))
    try:
        header, size = read_model_header(model)
        info = describe(header, file_bytes=size)
        check_executable(info.architecture)  # the check `strata inspect` shows and the operator makes
        local = plan_local(
            model=info,
            stages=args.stages,
            parallel=args.parallel,
            cache_type=CacheType(args.cache_type),
            available_bytes=available_memory_bytes(args.device),
            context=args.context,
        )
    except (GGUFError, ValueError) as exc:  # unreadable, not executable, more stages than layers, or it does not fit
        raise SystemExit(f"strata serve: {exc}") from exc
    spans, context = local.spans, local.context
    if local.usable_bytes is None:
        print(f"plan: the memory of {args.device} is unknown; not checked", flush=True)
    else:
        print(
            f"plan: {local.weight_bytes / GB:.2f} GB of weights and {local.kv_bytes / GB:.2f} GB of KV "
            f"({args.cache_type}) of {local.usable_bytes / GB:.1f} GB usable on {args.device}",
            flush=True,
        )
    watch = ServeWatch(load_timeout_s=args.load_timeout_seconds)
    watch.start()
    stages: list[StageProcess] = []
    try:
        next_stage = ""
        for index in reversed(range(len(spans))):
            start, end = spans[index]
            env = {
                "STRATA_STAGE_INDEX": str(index),
                "STRATA_LAYER_START": str(start),
                "STRATA_LAYER_END": str(end),
                "STRATA_MODEL_URL": model,
                "STRATA_CONTEXT": str(context),
                "STRATA_PARALLEL": str(args.parallel),
                "STRATA_CACHE_TYPE_K": args.cache_type,
                "STRATA_CACHE_TYPE_V": args.cache_type,
                "STRATA_NEXT_STAGE": next_stage,
                "STRATA_LISTEN": "127.0.0.1:0",
                "STRATA_DEVICE": args.device,
                "STRATA_PREFIX_CACHE_BYTES": str(args.prefix_cache_bytes),
            }
            stage = StageProcess(env=env, log_path=workdir / f"stage-{index}.log", abandon=watch.failed)
            stages.insert(0, stage)
            next_stage = f"127.0.0.1:{stage.port}"
            watch.add(WatchedStage(address=next_stage, name=f"stage {index}", exited=stage.exit_reason))
            print(f"stage {index}: layers [{start}, {end}) on {next_stage}", flush=True)
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
            micro_batches=args.micro_batches,
            api_keys=api_keys(environ=os.environ, keys_file=args.api_keys_file),
        )
        app, serving = build(settings, header=header)
        sock = bind(settings.listen)
        host, port = sock.getsockname()[:2]
        base = f"http://{host}:{port}/v1"
        print(f"serving {serving.model_name!r} ({len(spans)} stages, {args.parallel} lanes, context {context})")
        print(f"endpoint {base}  (stage logs in {workdir})", flush=True)
        pipeline = serving.pipeline
        watch.all_started(pipeline_ready=lambda: None if pipeline.ready else pipeline.not_ready_reason)
        serve(app, sock, stop=watch.failed)
    except StageStartError as exc:
        if not watch.failed.is_set():  # set: the watch abandoned this start and has printed the failure that did
            raise SystemExit(f"strata serve: {exc}") from exc
    except KeyboardInterrupt:  # Ctrl-C before the server took over the signal: stop as it would
        return EXIT_INTERRUPTED
    finally:
        watch.close()
        for stage in stages:
            stage.stop()
    return EXIT_STAGE_FAILED if watch.failed.is_set() else 0


def _demo_model(folder: Path) -> Path:
    from strata.gguf.testmodels import write_test_model

    path = folder / "strata-demo.gguf"
    write_test_model(path, architecture="qwen2", block_count=DEMO_LAYERS)
    return path
