"""What the operator gives the gateway to elect on its Lease: a ServiceAccount, a Role narrowed to that Lease (and
Events, to record a stage refusing its term), the token mounted in the gateway pod only, and the Lease's name and
timing in its environment; the holder and term come back into status, with an Event when they change.

The Role is checked by the real API server's RBAC authorizer (SubjectAccessReview), not by reading the manifest.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from strata.draining import DRAIN_S
from strata.gateway.settings import from_environment
from strata.gateway.speculation import DraftSource, Speculation
from strata.gguf.model import ModelInfo
from strata.lease import LeaseElector, LeaseTiming
from strata.operator.children import Owner, stage_statefulset
from strata.operator.cluster_cache import ClusterCache
from strata.operator.doorbells import Doorbells
from strata.operator.gateway_children import coordinator_lease, gateway_access, gateway_deployment
from strata.operator.kube import Cluster
from strata.operator.models import ModelCache
from strata.operator.names import Names
from strata.operator.outcome import Outcome
from strata.operator.reconcile import Reconciler
from strata.operator.spec import GROUP, PLURAL, ModelDeploymentSpec
from strata.operator.spec_fields import ModelSource, SecretKeyRef
from strata.operator.spec_scaling import Rollout
from strata.operator.spec_speculative import Speculative, SpeculativeMethod
from strata.operator.status import Coordinator, EventReason, ModelDeploymentStatus, PlanSummary, StageSummary
from strata.plan import Backend, Plan
from strata.plan import Stage as StagePlan
from strata_testbed.waiting import eventually, fresh_namespace

SPEC = ModelDeploymentSpec.from_manifest(
    {
        "model": {"url": "hf://acme/tiny-GGUF/tiny.Q8_0.gguf"},
        "coordination": {"leaseDurationSeconds": 9, "renewDeadlineSeconds": 6, "retryPeriodSeconds": 1},
    }
)
# The header of a draft: the gateway pod's memory request counts what it holds (strata.draft_memory).
DRAFT_INFO = ModelInfo(
    architecture="llama", block_count=1, embedding_length=64, head_count=4, head_count_kv=(4,), key_length=16,
    value_length=16, context_length=512, vocab_size=1000, layer_bytes=(1 << 20,), non_layer_bytes={},
    layer_resident_bytes=(1 << 20,), non_layer_resident_bytes={}, output_tied=True, cpu_resident_bytes=2 << 20,
)  # fmt: skip
SERVING = PlanSummary(
    generation=1,
    stages=[StageSummary(index=0, node="n0", gpus=1, backend="cuda", layerStart=0, layerEnd=4)],
    contextLength=4096,
    parallel=4,
    cacheTypeK="q8_0",
    cacheTypeV="q8_0",
)


def _env(manifest: dict[str, Any]) -> dict[str, Any]:
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_the_gateway_pod_gets_the_token_the_lease_and_the_timing_from_the_spec() -> None:
    owner = Owner(name="tiny", namespace="models", uid="u")
    pod = gateway_deployment(owner, SPEC, serving=SERVING, image="strata:dev", model_name="tiny")["spec"]["template"]
    assert pod["spec"]["serviceAccountName"] == "tiny-gateway"
    assert pod["spec"]["automountServiceAccountToken"] is True
    env = _env(gateway_deployment(owner, SPEC, serving=SERVING, image="strata:dev", model_name="tiny"))
    assert env["STRATA_LEASE_NAME"] == Names("tiny", "models").coordinator_lease
    assert env["STRATA_LEASE_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["STRATA_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["STRATA_ADVERTISE_URL"] == "http://$(POD_IP):8000", "where the standbys forward while it coordinates"
    assert (env["STRATA_DEPLOYMENT_NAME"], env["STRATA_DEPLOYMENT_UID"]) == ("tiny", "u"), "the object Events name"
    timing = [env[f"STRATA_{k}_SECONDS"] for k in ("LEASE_DURATION", "RENEW_DEADLINE", "RETRY_PERIOD")]
    assert timing == ["9", "6", "1"]


def test_the_gateway_reads_the_specs_speculative_decoding_from_the_environment_the_operator_sets() -> None:
    owner = Owner(name="tiny", namespace="models", uid="u")
    spec = SPEC.model_copy(update={"speculative": Speculative(method=SpeculativeMethod.NGRAM, maxDraft=6)})
    values = {e["name"]: e["value"] for e in _containers(spec, owner)[0]["env"] if "value" in e}
    assert from_environment({}, values).speculation() == Speculation(max_draft=6, min_draft=1)
    plain = {e["name"]: e["value"] for e in _containers(SPEC, owner)[0]["env"] if "value" in e}
    assert "STRATA_SPECULATIVE" not in plain
    assert from_environment({}, plain).speculation() is None


def test_the_gateway_chains_prompt_hashes_from_the_plans_cache_types() -> None:
    """Prefix keys name the stages' cache types, so snapshots of a q8_0 plan and an f16 one never share a key."""
    owner = Owner(name="tiny", namespace="models", uid="u")
    values = {e["name"]: e["value"] for e in _containers(SPEC, owner)[0]["env"] if "value" in e}
    assert from_environment({}, values).kv_cache_types == "q8_0/q8_0"


@pytest.mark.parametrize(
    ("rollout", "drain_s"), [({}, DRAIN_S), ({"drainSeconds": 120}, 120.0)], ids=["default", "set"]
)
def test_the_gateway_drains_a_leaving_pipeline_for_the_specs_drain(rollout: dict[str, int], drain_s: float) -> None:
    """The gateway's drain and the operator's bound on retired stages come from the same spec field."""
    owner = Owner(name="tiny", namespace="models", uid="u")
    spec = SPEC.model_copy(update={"rollout": Rollout.model_validate(rollout)})
    values = {e["name"]: e["value"] for e in _containers(spec, owner)[0]["env"] if "value" in e}
    assert from_environment({}, values).drain_seconds == drain_s
    assert spec.rollout.drain_seconds == drain_s


def test_the_gateway_reads_the_specs_draft_model_from_the_environment_the_operator_sets() -> None:
    owner = Owner(name="tiny", namespace="models", uid="u")
    draft = ModelSource(url="hf://org/small/small.gguf", tokenSecretRef=SecretKeyRef(name="hf"))
    speculative = Speculative(method=SpeculativeMethod.DRAFT, draftModel=draft, pMin=0.2)
    env = _containers(SPEC.model_copy(update={"speculative": speculative}), owner, draft=DRAFT_INFO)[0]["env"]
    values = {e["name"]: e["value"] for e in env if "value" in e}
    secrets = {e["name"]: e["valueFrom"] for e in env if "valueFrom" in e}
    assert secrets["STRATA_DRAFT_MODEL_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    settings = from_environment({}, values | {"STRATA_DRAFT_MODEL_TOKEN": "from-the-secret"})
    assert settings.speculation() == Speculation(p_min=0.2)
    assert settings.draft_source() == DraftSource(url=draft.url, token="from-the-secret")


def _containers(spec: ModelDeploymentSpec, owner: Owner, *, draft: ModelInfo | None = None) -> list[dict[str, Any]]:
    deployment = gateway_deployment(owner, spec, serving=SERVING, image="strata:dev", model_name="tiny", draft=draft)
    containers: list[dict[str, Any]] = deployment["spec"]["template"]["spec"]["containers"]
    return containers


def test_stage_pods_still_get_no_token() -> None:
    owner = Owner(name="tiny", namespace="models", uid="u")
    sizes = {k: 0 for k in ("memory_bytes", "usable_bytes", "weight_bytes", "buffer_bytes", "kv_bytes")}
    stage = StagePlan(
        index=0,
        node="n0",
        resource="nvidia.com/gpu",
        gpus=(0,),
        backend=Backend.CUDA,
        layer_start=0,
        layer_end=4,
        embeddings=True,
        output_head=True,
        **sizes,
    )
    plan = Plan.model_construct(
        stages=[stage], context_length=4096, parallel=4, cache_type_k="q8_0", cache_type_v="q8_0"
    )
    manifest = stage_statefulset(owner, SPEC, plan, stage, generation=1, image="strata:dev")
    assert manifest["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in manifest["spec"]["template"]["spec"]


@pytest.mark.parametrize(
    "coordination",
    [
        pytest.param({"retryPeriodSeconds": 10}, id="a retry period as long as the renew deadline is refused"),
        pytest.param({"renewDeadlineSeconds": 15}, id="a renew deadline as long as the lease is refused"),
    ],
)
def test_unsafe_coordination_timings_are_refused(coordination: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="retryPeriodSeconds < renewDeadlineSeconds < leaseDurationSeconds"):
        ModelDeploymentSpec.from_manifest({"model": {"url": "hf://acme/t/t.gguf"}, "coordination": coordination})


@pytest.fixture
def namespace(api_client: client.ApiClient) -> Iterator[str]:
    with fresh_namespace(api_client, "coord") as name:
        yield name


@pytest.fixture
def granted(api_client: client.ApiClient, namespace: str) -> Owner:
    """The rendered ServiceAccount, Role and RoleBinding, applied to the real API server."""
    owner = Owner(name="tiny", namespace=namespace, uid=str(uuid.uuid4()))
    cluster = Cluster(api_client, ClusterCache(api_client, namespaces=[namespace], doorbells=Doorbells()))
    for manifest in gateway_access(owner):
        manifest["metadata"].pop("ownerReferences")  # no ModelDeployment here to own them
        cluster.apply(manifest)
    return owner


def _allowed(
    api_client: client.ApiClient,
    *,
    namespace: str,
    verb: str,
    name: str,
    group: str = "coordination.k8s.io",
    resource: str = "leases",
) -> bool:
    review = client.AuthorizationV1Api(api_client).create_subject_access_review(
        {
            "spec": {
                "user": f"system:serviceaccount:{namespace}:tiny-gateway",
                "groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}"],
                "resourceAttributes": {
                    "namespace": namespace,
                    "verb": verb,
                    "group": group,
                    "resource": resource,
                    **({"name": name} if name else {}),
                },
            }
        }
    )
    return bool(review.status.allowed)


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("verb", "lease", "allowed"),
    [
        pytest.param("get", "own", True, id="the gateway reads its own Lease"),
        pytest.param("update", "own", True, id="the gateway renews its own Lease"),
        pytest.param("create", "", False, id="the gateway cannot create Leases: the operator creates its own"),
        pytest.param("update", "tiny-other", False, id="the gateway cannot renew another deployment's Lease"),
        pytest.param("get", "tiny-other", False, id="the gateway cannot read another deployment's Lease"),
        pytest.param("delete", "own", False, id="the gateway cannot delete its own Lease"),
        pytest.param("list", "", False, id="the gateway cannot list Leases"),
    ],
)
def test_the_gateway_role_allows_its_own_lease_and_nothing_else(
    api_client: client.ApiClient, granted: Owner, verb: str, lease: str, allowed: bool
) -> None:
    name = Names(granted.name, granted.namespace).coordinator_lease if lease == "own" else lease
    assert _allowed(api_client, namespace=granted.namespace, verb=verb, name=name) is allowed


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("verb", "deployment", "allowed"),
    [
        pytest.param("get", "own", True, id="the gateway reads its own ModelDeployment, for the pipelines that serve"),
        pytest.param("get", "tiny-other", False, id="the gateway cannot read another ModelDeployment"),
        pytest.param("list", "", False, id="the gateway cannot list ModelDeployments"),
        pytest.param("watch", "", False, id="the gateway cannot watch ModelDeployments"),
        pytest.param("patch", "own", False, id="the gateway cannot change its ModelDeployment"),
    ],
)
def test_the_gateway_role_allows_reading_its_own_deployment_and_nothing_more(
    api_client: client.ApiClient, granted: Owner, verb: str, deployment: str, allowed: bool
) -> None:
    name = granted.name if deployment == "own" else deployment
    checked = _allowed(api_client, namespace=granted.namespace, verb=verb, name=name, group=GROUP, resource=PLURAL)
    assert checked is allowed


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("verb", "group", "allowed"),
    [
        pytest.param("create", "", True, id="the gateway records Events on its deployment"),
        pytest.param("patch", "", False, id="the gateway cannot change Events"),
        pytest.param("list", "", False, id="the gateway cannot read Events"),
        pytest.param("delete", "", False, id="the gateway cannot delete Events"),
        pytest.param("create", "events.k8s.io", False, id="the gateway records through the core API only"),
    ],
)
def test_the_gateway_role_allows_creating_events_and_nothing_more(
    api_client: client.ApiClient, granted: Owner, verb: str, group: str, allowed: bool
) -> None:
    checked = _allowed(api_client, namespace=granted.namespace, verb=verb, name="", group=group, resource="events")
    assert checked is allowed


@pytest.mark.cluster
def test_status_follows_the_lease_holder_with_an_event_when_it_changes(
    api_client: client.ApiClient, namespace: str
) -> None:
    cache = ClusterCache(api_client, namespaces=[namespace], doorbells=Doorbells())
    cache.start(timeout=30)
    try:
        _follow_the_holder(api_client, namespace, Cluster(api_client, cache))
    finally:
        cache.stop()


def _follow_the_holder(api_client: client.ApiClient, namespace: str, cluster: Cluster) -> None:
    # The operator creates the (labelled) Lease it watches; the gateways only write its spec.
    created = coordinator_lease(Owner(name="tiny", namespace=namespace, uid=str(uuid.uuid4())))
    created["metadata"].pop("ownerReferences")  # no ModelDeployment here to own it
    cluster.apply(created)
    reconciler = Reconciler(
        cluster=cluster, models=ModelCache(), image="strata:dev", operator_namespace="strata-system"
    )
    lease = Names("tiny", namespace).coordinator_lease

    def watched(holder: tuple[str, int]) -> None:
        """The operator reads the Lease from its watch: wait until the watch has delivered the change."""
        eventually(
            lambda: cluster.lease_holder(namespace=namespace, name=lease) == holder, timeout=30, what=f"{holder}"
        )

    timing = LeaseTiming(duration_seconds=3, renew_deadline_seconds=2.0, retry_period_seconds=0.5)
    api = client.CoordinationV1Api(api_client)
    a, b = (LeaseElector(api=api, namespace=namespace, name=lease, identity=w, timing=timing) for w in ("a", "b"))
    outcome = Outcome(status=ModelDeploymentStatus())

    reconciler.observe_coordinator(namespace=namespace, name="tiny", outcome=outcome)
    assert outcome.status.coordinator is None, "nobody holds the Lease yet: no coordinator"
    assert a.try_acquire_or_renew() is not None
    watched(("a", 1))
    reconciler.observe_coordinator(namespace=namespace, name="tiny", outcome=outcome)
    reconciler.observe_coordinator(namespace=namespace, name="tiny", outcome=outcome)
    assert outcome.status.coordinator == Coordinator(holder="a", term=1)
    a.release()
    assert b.try_acquire_or_renew() is not None
    watched(("b", 2))
    reconciler.observe_coordinator(namespace=namespace, name="tiny", outcome=outcome)
    assert outcome.status.coordinator == Coordinator(holder="b", term=2)
    assert [(e.reason, e.message) for e in outcome.events] == [
        (
            EventReason.COORDINATOR_CHANGED,
            "gateway replica a coordinates the stages with term 1, as the first coordinator",
        ),
        (EventReason.COORDINATOR_CHANGED, "gateway replica b coordinates the stages with term 2, from a (term 1)"),
    ]
