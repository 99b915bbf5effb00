"""Assembling a gateway from its settings (tokenizer and template from the GGUF header, pipelines, admission) and
running it under uvicorn.

Only the header of the model file is read, over HTTP Range requests when the model is remote: the gateway needs the
vocabulary and the chat template, never the weights.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable
from pathlib import PurePosixPath
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import uvicorn
from fastapi import FastAPI
from strata.demand import DEMAND_ANNOTATION, Demand
from strata.gateway.admission import Admission, AdmissionPolicy
from strata.gateway.app import create_app
from strata.gateway.chat_template import ChatTemplate
from strata.gateway.cold_start import ColdStart
from strata.gateway.forwarding import Relay, advertisement
from strata.gateway.metrics import GatewayMetrics
from strata.gateway.pipeline import Pipeline
from strata.gateway.pipelines import PipelineEntry, Pipelines
from strata.gateway.prefix_index import prefix_seed
from strata.gateway.serving import Serving
from strata.gateway.settings import GatewaySettings
from strata.gateway.speculation import Drafter
from strata.gateway.tokenizer import GGUFTokenizer, TokenizerSpec
from strata.gguf import read_model_header
from strata.gguf.header import GGUFHeader
from strata.lease import FencingToken

if TYPE_CHECKING:
    from strata.gateway.events import EventRecorder
    from strata.gateway.pipeline_list import DeploymentPipelines, PipelineFollower

log = logging.getLogger(__name__)


def model_name(header: GGUFHeader, url: str) -> str:
    name = header.metadata.get("general.name")
    if isinstance(name, str) and name:
        return name
    return PurePosixPath(urlsplit(url).path).stem or url


def build(settings: GatewaySettings, *, header: GGUFHeader | None = None) -> tuple[FastAPI, Serving]:
    if header is None:
        header, _size = read_model_header(settings.model_url, token=settings.model_token)
    tokenizer = GGUFTokenizer(TokenizerSpec.from_metadata(header.metadata))
    spec = tokenizer.spec
    template = (
        ChatTemplate(
            spec.chat_template,
            bos_token=tokenizer.token(spec.bos_id) if spec.bos_id is not None else "",
            eos_token=tokenizer.token(spec.eos_id) if spec.eos_id is not None else "",
        )
        if spec.chat_template
        else None
    )
    metrics = GatewayMetrics()
    events = event_recorder(settings)
    drafters = draft_model(settings, target=header)
    seed = prefix_seed(model=f"{settings.model_url} {settings.model_name}", cache_type=settings.kv_cache_types)

    def driver(entry: PipelineEntry, fence: FencingToken | None, on_ready_change: Callable[[bool], None]) -> Pipeline:
        return Pipeline(
            first_stage=entry.first_stage,
            slots=entry.parallel,
            context=entry.context,
            fence=fence,
            plan_generation=entry.generation,
            prefill_chunk=settings.prefill_chunk,
            prefix_chunk=settings.prefix_cache_chunk,
            prefix_seed=seed,
            micro_batches=settings.micro_batches,
            speculation=settings.speculation(),
            drafters=drafters,
            metrics=metrics.for_pipeline(entry.index),
            on_ready_change=on_ready_change,
            on_fenced=events.fenced if events is not None else lambda _fence, _details: None,
        )

    policy = AdmissionPolicy(
        lanes=settings.parallel,
        queue_per_lane=settings.queue_per_lane,
        max_wait_s=settings.max_wait_seconds,
        retry_after_s=settings.retry_after_seconds,
    )
    admission = Admission(policy, metrics=metrics)
    pipelines = Pipelines(
        make_driver=driver,
        metrics=metrics,
        fence=None if settings.lease_name else settings.fence,
        prefix_chunk=settings.prefix_cache_chunk,
        on_capacity=admission.resize,
        drain_s=settings.drain_seconds,
    )
    source = deployment_source(settings)
    cold_start = (
        ColdStart(
            wait_s=settings.cold_start_seconds,
            retry_after_s=settings.retry_after_seconds,
            progress=lambda: source.report if source is not None else None,
        )
        if settings.cold_start_seconds
        else None
    )
    serving = Serving(
        model_name=settings.model_name or model_name(header, settings.model_url),
        tokenizer=tokenizer,
        template=template,
        pipelines=pipelines,
        admission=admission,
        metrics=metrics,
        context=settings.context,
        cold_start=cold_start,
    )
    relay = Relay(reply_timeout_s=settings.forward_timeout_seconds) if settings.lease_name else None
    hooks = lifespan_hooks(
        settings, pipelines, events=events, source=source, demand=serving.demand, cold_start=cold_start, relay=relay
    )
    app = create_app(serving, api_keys=settings.api_keys, lifespan_hooks=hooks, relay=relay)
    return app, serving


def draft_model(settings: GatewaySettings, *, target: GGUFHeader) -> Callable[[tuple[int, ...]], Drafter | None] | None:
    """With method "draft": the loaded draft model's drafter factory, one draft slot a lane; else None (n-gram
    lookup, or no speculation). Raises DraftModelError for a draft that cannot draft for the target."""
    source = settings.draft_source()
    if source is None:
        return None
    from strata.gateway.draft_model import load_draft_model  # torch and the stage engine, only when drafting

    speculation = settings.speculation()
    assert speculation is not None, "method draft is speculative decoding"
    loaded = load_draft_model(
        source,
        target=target,
        target_url=settings.model_url,
        speculation=speculation,
        context=settings.context,
        slots=settings.parallel,
    )
    log.info("draft model %s loaded on %s: %d slots", source.url, source.device, settings.parallel)
    return loaded.drafter


def first_pipeline(settings: GatewaySettings) -> PipelineEntry:
    """The pipeline the settings name: the only one without a deployment, the first until its status is read."""
    return PipelineEntry(
        index=0,
        generation=settings.plan_generation,
        first_stage=settings.first_stage,
        parallel=settings.parallel,
        context=settings.context,
    )


def event_recorder(settings: GatewaySettings) -> EventRecorder | None:
    """Events go to the API server, which only an electing gateway talks to, about the deployment it is told of."""
    if not (settings.lease_name and settings.deployment_name):
        return None
    from strata.gateway.events import deployment_recorder

    return deployment_recorder(
        namespace=settings.lease_namespace,
        name=settings.deployment_name,
        uid=settings.deployment_uid,
        reporter=settings.pod_name or socket.gethostname(),
    )


def lifespan_hooks(
    settings: GatewaySettings,
    pipelines: Pipelines,
    *,
    events: EventRecorder | None = None,
    source: DeploymentPipelines | None = None,
    demand: Callable[[], Demand] | None = None,
    cold_start: ColdStart | None = None,
    relay: Relay | None = None,
) -> tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]:
    """Start the drivers and the follower of the pipelines list, then the election; on the way out release the
    Lease before closing the drivers. The coordinator writes `demand` and its address on the Lease with each
    renewal; `relay` hears each round's outcome."""
    follower = pipeline_follower(settings, pipelines, source) if source is not None else None

    async def start_pipelines() -> None:
        await pipelines.start([first_pipeline(settings)])
        if follower is not None:
            await follower.start()

    async def stop_pipelines() -> None:
        if follower is not None:
            await follower.close()
        await pipelines.close()

    if not settings.lease_name:
        return start_pipelines, stop_pipelines
    from strata.gateway.coordination import Coordinator, build_elector

    elector = build_elector(
        namespace=settings.lease_namespace,
        name=settings.lease_name,
        identity=settings.identity(),
        timing=settings.lease_timing(),
    )
    address = advertisement(identity=elector.identity, url=settings.advertise_url)

    def annotate() -> dict[str, str]:
        return address | ({DEMAND_ANNOTATION: demand().encode()} if demand is not None else {})

    coordinator = Coordinator(elector=elector, pipeline=pipelines, annotate=annotate, relay=relay)
    if cold_start is not None:
        cold_start.listeners.append(coordinator.wake)
    log.info(
        "electing a coordinator on Lease %s/%s as %s", settings.lease_namespace, settings.lease_name, elector.identity
    )

    async def start() -> None:
        await start_pipelines()
        await coordinator.start()

    async def stop() -> None:
        await coordinator.close()
        if relay is not None:
            await relay.close()
        await stop_pipelines()
        if events is not None:
            events.close()

    return start, stop


def deployment_source(settings: GatewaySettings) -> DeploymentPipelines | None:
    """The deployment whose status lists the serving pipelines, when the settings ask to follow it (the operator
    does)."""
    if not settings.pipelines_poll_seconds:
        return None
    from kubernetes import client
    from strata.gateway.coordination import kube_client
    from strata.gateway.pipeline_list import DeploymentPipelines

    return DeploymentPipelines(
        api=client.CustomObjectsApi(kube_client()), namespace=settings.lease_namespace, name=settings.deployment_name
    )


def pipeline_follower(settings: GatewaySettings, pipelines: Pipelines, source: DeploymentPipelines) -> PipelineFollower:
    """Follows the deployment's serving pipelines."""
    from strata.gateway.pipeline_list import PipelineFollower

    return PipelineFollower(
        read=source.read,
        apply=pipelines.update,
        period_s=settings.pipelines_poll_seconds,
        source=f"ModelDeployment {source.namespace}/{source.name}",
    )


def bind(listen: str) -> socket.socket:
    """A listening socket for `host:port` (port 0 picks a free one), so the caller knows the port before serving."""
    host, _, port = listen.rpartition(":")
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]") or "0.0.0.0", int(port)))  # noqa: S104
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def http_server(app: FastAPI) -> uvicorn.Server:
    """The gateway's uvicorn server; setting its `should_exit` shuts it down as SIGTERM would."""
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5, lifespan="on")
    return uvicorn.Server(config)


def serve(app: FastAPI, sock: socket.socket) -> None:
    """Run until SIGINT or SIGTERM (uvicorn's handlers), then shut down gracefully."""
    try:
        http_server(app).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down; that is the normal way out
        return
