"""What one gateway is told to be: the model, the first stage, the lanes and the admission policy.

With a Lease name the replicas elect a coordinator on that Lease (strata.gateway.coordination) and the one that holds
it drives the pipeline; without one the gateway is the only coordinator and uses a fixed token. With a deployment
name as well, a stage refusing the coordinator's term is recorded as an Event on that ModelDeployment, and with
a pipelines poll period the gateway drives every pipeline that deployment's status says serves
(strata.gateway.pipeline_list); without one it drives the one pipeline at the first stage given here.

The operator sets these through the gateway container's environment (operator/strata/operator/children.py); the same
names work as flags of `strata gateway`, and a flag wins over the environment. API keys come from STRATA_API_KEYS
(comma-separated) or STRATA_API_KEYS_FILE (one per line, typically a mounted Secret); they are never logged.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from strata.draining import DRAIN_S
from strata.gateway.speculation import DEFAULTS as DRAFT_DEFAULTS
from strata.gateway.speculation import DraftSource, Speculation
from strata.gguf.model import UBATCH_TOKENS
from strata.lease import FencingToken, LeaseTiming
from strata.settings import Option, resolve_options

# One step at a time unless asked. Splitting the lanes into micro-batches lets two stages compute at once, but each
# step then holds half the lanes, and a decode step costs about the same at half the batch (it reads every weight
# either way): the overlap buys back what the extra steps cost, no more, unless steps are compute-bound or the hops
# between stages are slow. bench/stage_decode.py on 2 CPU cores, 2 stages, 4 lanes: decode 0.92-0.97x with 2,
# prefill-heavy (240-token prompts) 1.08-1.10x. Set 2 (STRATA_MICRO_BATCHES, --micro-batches) where a measurement on
# the target GPUs says it pays; a pipeline of one stage ignores it.
DEFAULT_MICRO_BATCHES = 1

# A prompt is prefilled this many tokens a step (chunks end on multiples of it, after a restored prefix too, so that
# from there on a restored request prefills the spans a full prefill would), so decoding slots keep stepping while a
# long prompt goes in. On a GPU a step of more than quant_matmul.GEMM_MAX_ROWS rows dequantises each matrix for
# cuBLAS, a cost a step that longer chunks share; `bench/residency.py` times a 4,096-token prompt's first token in
# chunks of several sizes. At most UBATCH_TOKENS: the plan sizes a stage's activations and its sliding-window
# layers' spare cells for that many new rows a step.
DEFAULT_PREFILL_CHUNK = 256

# Speculative decoding's methods: n-gram lookup over the request's own context, or a draft model of the target's
# vocabulary run in the gateway process (strata.gateway.draft_model).
SPECULATIVE_METHODS = ("", "ngram", "draft")

# Flag, environment variable, type, default (None: required).
OPTIONS: tuple[Option, ...] = tuple(
    Option(*row)
    for row in (
        ("--model-url", "STRATA_MODEL_URL", str, None),
        ("--model-name", "STRATA_MODEL_NAME", str, ""),
        ("--first-stage", "STRATA_FIRST_STAGE", str, None),
        ("--parallel", "STRATA_PARALLEL", int, 4),
        ("--context", "STRATA_CONTEXT", int, None),
        ("--queue-per-lane", "STRATA_QUEUE_PER_LANE", int, 1),
        ("--max-wait-seconds", "STRATA_MAX_WAIT_SECONDS", float, 10.0),
        ("--retry-after-seconds", "STRATA_RETRY_AFTER_SECONDS", int, 1),
        ("--listen", "STRATA_LISTEN", str, "0.0.0.0:8000"),
        ("--plan-generation", "STRATA_PLAN_GENERATION", int, 0),
        ("--api-keys-file", "STRATA_API_KEYS_FILE", str, ""),
        ("--lease-name", "STRATA_LEASE_NAME", str, ""),
        ("--lease-namespace", "STRATA_LEASE_NAMESPACE", str, "default"),
        ("--lease-duration-seconds", "STRATA_LEASE_DURATION_SECONDS", int, 15),
        ("--renew-deadline-seconds", "STRATA_RENEW_DEADLINE_SECONDS", float, 10.0),
        ("--retry-period-seconds", "STRATA_RETRY_PERIOD_SECONDS", float, 2.0),
        ("--pod-name", "STRATA_POD_NAME", str, ""),
        ("--advertise-url", "STRATA_ADVERTISE_URL", str, ""),
        ("--forward-timeout-seconds", "STRATA_FORWARD_TIMEOUT_SECONDS", float, 600.0),
        ("--deployment-name", "STRATA_DEPLOYMENT_NAME", str, ""),
        ("--deployment-uid", "STRATA_DEPLOYMENT_UID", str, ""),
        ("--prefix-cache-chunk", "STRATA_PREFIX_CACHE_CHUNK", int, 256),
        ("--prefill-chunk", "STRATA_PREFILL_CHUNK", int, DEFAULT_PREFILL_CHUNK),
        ("--kv-cache-types", "STRATA_KV_CACHE_TYPES", str, ""),
        ("--micro-batches", "STRATA_MICRO_BATCHES", int, DEFAULT_MICRO_BATCHES),
        ("--pipelines-poll-seconds", "STRATA_PIPELINES_POLL_SECONDS", float, 0.0),
        ("--speculative", "STRATA_SPECULATIVE", str, ""),
        ("--max-draft", "STRATA_MAX_DRAFT", int, DRAFT_DEFAULTS.max_draft),
        ("--min-draft", "STRATA_MIN_DRAFT", int, DRAFT_DEFAULTS.min_draft),
        ("--draft-model", "STRATA_DRAFT_MODEL_URL", str, ""),
        ("--draft-device", "STRATA_DRAFT_DEVICE", str, "cpu"),
        ("--p-min", "STRATA_P_MIN", float, DRAFT_DEFAULTS.p_min),
        ("--position-cost", "STRATA_POSITION_COST", float, DRAFT_DEFAULTS.position_cost),
        ("--cold-start-seconds", "STRATA_COLD_START_SECONDS", float, 0.0),
        ("--drain-seconds", "STRATA_DRAIN_SECONDS", float, DRAIN_S),
    )
)


def prefill_chunk_refusal(prefill_chunk: int) -> str | None:
    """Why the stages cannot take prefill steps of `prefill_chunk` tokens, or None."""
    if not 1 <= prefill_chunk <= UBATCH_TOKENS:
        return (
            f"the prefill chunk must be 1 to {UBATCH_TOKENS} tokens (the rows a step the plan sizes a stage's "
            f"activations and sliding-window cells for), not {prefill_chunk}"
        )
    return None


def local_fence() -> FencingToken:
    """The fixed token of a gateway that is the only coordinator (single-machine mode, or before elections)."""
    return FencingToken(lease_uid="static", term=1, holder=socket.gethostname())


@dataclass(frozen=True, kw_only=True)
class GatewaySettings:
    model_url: str
    first_stage: str
    context: int
    model_name: str = ""  # empty: the file's general.name, else its file name
    parallel: int = 4
    queue_per_lane: int = 1
    max_wait_seconds: float = 10.0
    retry_after_seconds: int = 1
    listen: str = "0.0.0.0:8000"
    plan_generation: int = 0
    api_keys_file: str = ""
    lease_name: str = ""  # empty: no election, this gateway is the only coordinator
    lease_namespace: str = "default"
    lease_duration_seconds: int = 15
    renew_deadline_seconds: float = 10.0
    retry_period_seconds: float = 2.0
    pod_name: str = ""
    # Where the other replicas reach this one while it coordinates (http://POD_IP:PORT), written on the Lease; empty:
    # they cannot forward to it and answer 503 while it holds the Lease.
    advertise_url: str = ""
    forward_timeout_seconds: float = 600.0  # a standby's wait for the coordinator's reply (each event of a stream)
    deployment_name: str = ""  # the ModelDeployment that Events name (in lease_namespace); empty: no Events
    deployment_uid: str = ""
    prefix_cache_chunk: int = 256  # tokens per prefix-cache chunk (snapshots are taken at multiples); 0: off
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # prompt tokens a step prefills at most (chunks end on multiples)
    kv_cache_types: str = ""  # the stages' K/V cache types ("q8_0/q8_0"): prompt hashes chain from them
    micro_batches: int = DEFAULT_MICRO_BATCHES  # steps of disjoint slots in flight at once (with 2+ stages)
    pipelines_poll_seconds: float = 0.0  # how often the deployment's serving pipelines are read; 0: one pipeline
    speculative: str = ""  # "ngram" or "draft": how requests' drafts are made (strata.gateway.speculation)
    max_draft: int = DRAFT_DEFAULTS.max_draft
    min_draft: int = DRAFT_DEFAULTS.min_draft
    draft_model: str = ""  # the draft GGUF of method "draft": a path or URL, as the model's own
    draft_device: str = "cpu"  # where the draft computes, in the gateway process
    p_min: float = DRAFT_DEFAULTS.p_min  # a draft's proposal stops before its first pick less likely than this
    # What one more position adds to a step, in one-position steps: how long drafts are (strata.gateway.draft_lengths)
    position_cost: float = DRAFT_DEFAULTS.position_cost
    # While no pipeline serves, a request is held this long for one to load (the operator scales up on the demand
    # this gateway reports); 0: answered 503 at once, and the gateway is not ready without a pipeline.
    cold_start_seconds: float = 0.0
    # A pipeline that leaves the deployment's list finishes what it runs within this, or fails it with a retryable 503.
    drain_seconds: float = DRAIN_S
    api_keys: frozenset[str] = field(default=frozenset(), repr=False)
    model_token: str | None = field(default=None, repr=False)
    draft_model_token: str | None = field(default=None, repr=False)
    fence: FencingToken = field(default_factory=local_fence)

    def __post_init__(self) -> None:
        if self.context < 2 or self.parallel < 1:
            raise ValueError(f"context ({self.context}) must be at least 2 and parallel ({self.parallel}) positive")
        if self.prefix_cache_chunk < 0:
            raise ValueError(f"the prefix cache chunk must not be negative, not {self.prefix_cache_chunk}")
        if (refusal := prefill_chunk_refusal(self.prefill_chunk)) is not None:
            raise ValueError(refusal)
        if self.micro_batches < 1:
            raise ValueError(f"micro-batches must be at least 1, not {self.micro_batches}")
        if self.pipelines_poll_seconds < 0 or (self.pipelines_poll_seconds and not self.deployment_name):
            raise ValueError(
                f"a pipelines poll period ({self.pipelines_poll_seconds} s) must not be negative and needs the "
                "deployment name whose status lists the pipelines"
            )
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative decoding method {self.speculative!r} is not one of: ngram, draft, or empty for off"
            )
        default = DRAFT_DEFAULTS
        drafting = (self.max_draft, self.min_draft, self.position_cost)
        if not self.speculative and drafting != (default.max_draft, default.min_draft, default.position_cost):
            raise ValueError(
                "draft bounds (max draft, min draft) and a position cost apply to speculative decoding, which is off"
            )
        refusal = draft_model_refusal(
            speculative=self.speculative, draft_model=self.draft_model, draft_device=self.draft_device, p_min=self.p_min
        )
        if refusal is not None:
            raise ValueError(refusal)
        self.speculation()  # refuses draft bounds out of range at start-up
        if self.cold_start_seconds < 0 or (self.cold_start_seconds and not self.pipelines_poll_seconds):
            raise ValueError(
                f"a cold-start wait ({self.cold_start_seconds} s) must not be negative and needs the pipelines "
                "followed (a pipelines poll period): only a deployment's pipelines come and go"
            )
        if self.drain_seconds <= 0:
            raise ValueError(f"the drain of a pipeline leaving service must be positive, not {self.drain_seconds} s")
        if self.lease_name:
            self.lease_timing()  # refuses unsafe timings at start-up, not at the first election

    def speculation(self) -> Speculation | None:
        if not self.speculative:
            return None
        return Speculation(
            max_draft=self.max_draft, min_draft=self.min_draft, p_min=self.p_min, position_cost=self.position_cost
        )

    def draft_source(self) -> DraftSource | None:
        """The draft model to load, with speculative decoding's method "draft"."""
        if self.speculative != "draft":
            return None
        return DraftSource(url=self.draft_model, token=self.draft_model_token, device=self.draft_device)

    def lease_timing(self) -> LeaseTiming:
        return LeaseTiming(
            duration_seconds=self.lease_duration_seconds,
            renew_deadline_seconds=self.renew_deadline_seconds,
            retry_period_seconds=self.retry_period_seconds,
        )

    def identity(self) -> str:
        """The Lease holder: the pod name and a per-process suffix, so a restarted container takes a new term
        instead of silently inheriting the term its previous incarnation held."""
        return f"{self.pod_name or socket.gethostname()}-{uuid.uuid4().hex[:6]}"

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host or "0.0.0.0", int(port)  # noqa: S104 (a server listens on every interface by default)


def draft_model_refusal(*, speculative: str, draft_model: str, draft_device: str, p_min: float) -> str | None:
    """Why the draft-model options do not fit together (None when they do): method "draft" needs a draft model, and
    the draft's options (file, device, probability floor) mean nothing to another method."""
    drafting = speculative == "draft"
    if drafting and not draft_model:
        return "speculative decoding method draft needs the draft model's file (--draft-model, STRATA_DRAFT_MODEL_URL)"
    given = [
        name
        for name, set_ in (
            ("a draft model", bool(draft_model)),
            ("a draft device", draft_device != "cpu"),
            ("a draft probability floor (p min)", p_min != DRAFT_DEFAULTS.p_min),
        )
        if set_
    ]
    if given and not drafting:
        method = f"method {speculative}" if speculative else "speculative decoding off"
        return f"{' and '.join(given)} apply to speculative decoding method draft only, not with {method}"
    return None


def resolve(values: Mapping[str, object], environ: Mapping[str, str], *, command: str) -> dict[str, object]:
    return resolve_options(OPTIONS, values, environ, command=command)


def api_keys(*, environ: Mapping[str, str], keys_file: str) -> frozenset[str]:
    keys = {k.strip() for k in environ.get("STRATA_API_KEYS", "").split(",") if k.strip()}
    if keys_file:
        keys |= {line.strip() for line in Path(keys_file).read_text().splitlines() if line.strip()}
    return frozenset(keys)


def from_environment(values: Mapping[str, object], environ: Mapping[str, str] | None = None) -> GatewaySettings:
    env = dict(os.environ if environ is None else environ)
    resolved = resolve(values, env, command="gateway")
    try:
        keys = api_keys(environ=env, keys_file=str(resolved["api_keys_file"]))
    except OSError as exc:
        raise SystemExit(f"strata gateway: cannot read the API keys file: {exc.strerror}") from exc
    try:
        return GatewaySettings(
            **resolved,  # type: ignore[arg-type]
            api_keys=keys,
            model_token=env.get("STRATA_MODEL_TOKEN"),
            draft_model_token=env.get("STRATA_DRAFT_MODEL_TOKEN"),
        )
    except ValueError as exc:
        raise SystemExit(f"strata gateway: {exc}") from exc
