"""`strata gateway`: the OpenAI-compatible gateway of one deployment, configured as the operator configures it.

    STRATA_MODEL_URL             GGUF file (path, file://, http(s)://, hf://); only its header is read
    STRATA_MODEL_NAME            the id clients use (`org/repo:Q4`; `@main` may be added or left out)
    STRATA_FIRST_STAGE           host:port of stage 0
    STRATA_PARALLEL              lanes: the plan's parallel slots
    STRATA_CONTEXT               the plan's context length (KV cells shared by the lanes)
    STRATA_QUEUE_PER_LANE        requests that may wait per lane when all are busy (default 1)
    STRATA_MAX_WAIT_SECONDS      the longest a request waits for a lane before a 429 (default 10)
    STRATA_RETRY_AFTER_SECONDS   Retry-After on 429 (default 1)
    STRATA_LISTEN                HTTP address (default 0.0.0.0:8000)
    STRATA_PLAN_GENERATION       the plan generation the stages serve (default 0)
    STRATA_API_KEYS_FILE         a file of accepted API keys, one per line (or STRATA_API_KEYS, comma-separated)
    STRATA_LEASE_NAME            the coordination.k8s.io Lease the replicas elect a coordinator on (default: none)
    STRATA_LEASE_NAMESPACE       its namespace (default "default")
    STRATA_LEASE_DURATION_SECONDS, STRATA_RENEW_DEADLINE_SECONDS, STRATA_RETRY_PERIOD_SECONDS  (default 15, 10, 2)
    STRATA_POD_NAME              this replica's name in the Lease (default: the hostname)
    STRATA_PREFIX_CACHE_CHUNK    prefix snapshots are taken every N prompt tokens (default 256; 0: no prefix cache)
    STRATA_PREFILL_CHUNK         a prompt goes in at most N tokens a step, chunks ending on multiples of N; 1 to 512,
                                 the plan's micro-batch (default 256)
    STRATA_KV_CACHE_TYPES        the stages' K/V cache types (e.g. q8_0/q8_0): prompt hashes chain from them, so
                                 snapshots of two cache types never share a key (default: unnamed)
    STRATA_DEPLOYMENT_NAME       the ModelDeployment (in the Lease's namespace) Events are recorded on
    STRATA_PIPELINES_POLL_SECONDS  read that ModelDeployment's status this often and drive every pipeline it lists
                                 as serving, routing each request by its prompt's prefix (default 0: the one
                                 pipeline at STRATA_FIRST_STAGE)
    STRATA_COLD_START_SECONDS    while no pipeline serves, hold a request this long for one to load, reporting it as
                                 demand on the Lease (the operator scales up on it), then answer 503 with the load
                                 progress (default 0: 503 at once; needs STRATA_PIPELINES_POLL_SECONDS)

Flags of the same names win over the environment. With a Lease, the replica holding it drives the pipeline with the
fencing token (Lease uid, term) and the others stand by, not ready (/readyz 503); the API server is reached with the
pod's ServiceAccount, or outside a cluster with the kubeconfig KUBECONFIG names. Without a Lease the gateway is the
only coordinator, with a fixed token (term 1). Either way a stage refusing the token (FAILED_PRECONDITION) makes it
step down.
"""

from __future__ import annotations

import argparse
import logging

from strata.gateway.settings import OPTIONS
from strata.settings import add_options


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "gateway",
        help="serve the OpenAI API in front of a running pipeline of stages",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(parser, OPTIONS)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from strata.gateway.server import bind, build, serve
    from strata.gateway.settings import from_environment
    from strata.gateway.speculation import DraftModelError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = from_environment(vars(args))
    try:
        app, serving = build(settings)
    except DraftModelError as exc:
        raise SystemExit(f"strata gateway: {exc}") from exc
    sock = bind(settings.listen)
    host, port = sock.getsockname()[:2]
    print(f"gateway serving {serving.model_name!r} on http://{host}:{port}/v1", flush=True)
    serve(app, sock)
    return 0
