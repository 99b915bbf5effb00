"""The gateway's children of a ModelDeployment, rendered as plain manifests (no I/O): its Deployment, Service and
Ingress, the Lease its replicas coordinate through, and the least-privilege access that Lease needs.
strata.operator.children renders the stages' and holds what both share."""

from __future__ import annotations

from strata.draft_memory import DRAFT_CACHE_TYPE, draft_memory, memory_request
from strata.gguf.model import ModelInfo
from strata.operator.children import (
    GATEWAY_REQUESTS,
    POD_TMP,
    Manifest,
    Owner,
    container_security,
    env_list,
    owned_metadata,
    resources,
)
from strata.operator.names import (
    GATEWAY_PORT,
    Names,
    labels,
)
from strata.operator.spec import GROUP, PLURAL, ModelDeploymentSpec
from strata.operator.speculative_env import speculative_env
from strata.operator.status import PlanSummary


def gateway_access(owner: Owner) -> list[Manifest]:
    """The gateway's ServiceAccount and the least it needs: its own coordinator Lease, read and renewed; its own
    ModelDeployment, read, for the pipelines its status says serve; and Events, to record a stage refusing its term
    on the ModelDeployment.

    The operator creates that Lease (coordinator_lease), so every Lease verb is narrowed to it by name: a gateway
    can neither create Leases nor touch another deployment's. The deployment is read by name too (the operator holds
    `get` on ModelDeployments, so it may grant it; it holds no read of ConfigMaps, which is why the gateway does not
    read the pipelines ConfigMap). It may create Events in its namespace, to record a term the stages refused.
    """
    names = Names(owner.name, owner.namespace)

    def meta() -> Manifest:
        return owned_metadata(owner, name=names.gateway_account, labels=labels(owner.name, component="gateway"))

    leases = {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"]}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(), "automountServiceAccountToken": False},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta(),
            "rules": [
                leases | {"verbs": ["get", "update"], "resourceNames": [names.coordinator_lease]},
                {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["get"], "resourceNames": [owner.name]},
                {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta(),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": names.gateway_account},
            "subjects": [{"kind": "ServiceAccount", "name": names.gateway_account, "namespace": owner.namespace}],
        },
    ]


def coordinator_lease(owner: Owner) -> Manifest:
    """The Lease the gateway replicas elect their coordinator on, created empty and owned by the deployment, so it
    goes with it. The gateways write its spec; server-side apply leaves the fields this manifest does not name."""
    names = Names(owner.name, owner.namespace)
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": owned_metadata(owner, name=names.coordinator_lease, labels=labels(owner.name, component="gateway")),
    }


def gateway_deployment(
    owner: Owner,
    spec: ModelDeploymentSpec,
    *,
    serving: PlanSummary,
    image: str,
    model_name: str,
    draft: ModelInfo | None = None,
) -> Manifest:
    """The gateway drives the `serving` generation: the previous one until every stage of a new one is ready. With
    speculative decoding's method draft, `draft` is the draft model's header: the pod's default memory request grows
    by what the draft holds at the serving plan's context and lanes (strata.draft_memory)."""
    names = Names(owner.name, owner.namespace)
    requests = GATEWAY_REQUESTS
    if spec.speculative is not None and spec.speculative.draft_model is not None:
        if draft is None:
            raise ValueError("a gateway that runs a draft model needs the draft's header to size its memory")
        held = draft_memory(draft, context=serving.context_length, slots=serving.parallel, cache_type=DRAFT_CACHE_TYPE)
        requests = requests | {"memory": memory_request(GATEWAY_REQUESTS["memory"], held)}
    pod_labels = labels(owner.name, component="gateway")
    env = env_list(
        {
            "STRATA_MODEL_URL": spec.model.url,
            "STRATA_MODEL_NAME": model_name,
            "STRATA_FIRST_STAGE": names.stage_address(generation=serving.generation, index=0),
            "STRATA_PLAN_CONFIGMAP": names.plan_configmap,
            "STRATA_PARALLEL": serving.parallel,
            "STRATA_CONTEXT": serving.context_length,
            "STRATA_KV_CACHE_TYPES": f"{serving.cache_type_k}/{serving.cache_type_v}",
            "STRATA_QUEUE_PER_LANE": spec.admission.queue_per_lane,
            "STRATA_MAX_WAIT_SECONDS": spec.admission.max_wait_seconds,
            "STRATA_RETRY_AFTER_SECONDS": spec.admission.retry_after_seconds,
            "STRATA_DRAIN_SECONDS": spec.rollout.drain_seconds,
            "STRATA_LISTEN": f"0.0.0.0:{GATEWAY_PORT}",
            "STRATA_PLAN_GENERATION": serving.generation,
            "STRATA_LEASE_NAME": names.coordinator_lease,
            # The gateway records a stage refusing its term as an Event on this ModelDeployment.
            "STRATA_DEPLOYMENT_NAME": owner.name,
            "STRATA_DEPLOYMENT_UID": owner.uid,
            "STRATA_LEASE_DURATION_SECONDS": spec.coordination.lease_duration_seconds,
            "STRATA_RENEW_DEADLINE_SECONDS": spec.coordination.renew_deadline_seconds,
            "STRATA_RETRY_PERIOD_SECONDS": spec.coordination.retry_period_seconds,
            # The gateway drives every pipeline that status.pipelines lists as serving, read this often.
            "STRATA_PIPELINES_POLL_SECONDS": spec.coordination.retry_period_seconds,
        }
    )
    env += speculative_env(spec.speculative)
    if spec.autoscaling is not None:
        # With no pipeline serving (scaled to zero, or all loading) the gateway stays ready and holds a request this
        # long, reporting it as demand on the coordinator Lease so that the operator brings a pipeline up.
        env += env_list({"STRATA_COLD_START_SECONDS": spec.autoscaling.cold_start_wait_seconds})
    if spec.gateway.api_key_secret_ref is not None:
        ref = spec.gateway.api_key_secret_ref
        env.append({"name": "STRATA_API_KEYS", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    # The Lease lives beside the gateway; each replica is known in it by its pod name, and the coordinator writes its
    # pod address there so that the standbys forward requests to it (strata.gateway.forwarding).
    env += [
        {"name": "STRATA_LEASE_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "STRATA_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "STRATA_ADVERTISE_URL", "value": f"http://$(POD_IP):{GATEWAY_PORT}"},
    ]
    http_probe = {"httpGet": {"path": "/readyz", "port": GATEWAY_PORT}, "periodSeconds": 5}
    container = {
        "name": "gateway",
        "image": image,
        "command": ["strata", "gateway"],
        "env": env,
        "ports": [{"name": "http", "containerPort": GATEWAY_PORT}],
        "readinessProbe": http_probe,
        "livenessProbe": http_probe | {"httpGet": {"path": "/healthz", "port": GATEWAY_PORT}, "failureThreshold": 6},
        "resources": resources(spec.gateway.resources, defaults=requests),
        "securityContext": container_security(),
        "volumeMounts": [{"name": "tmp", "mountPath": POD_TMP}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": owned_metadata(owner, name=names.gateway, labels=pod_labels),
        "spec": {
            "replicas": spec.gateway.replicas,
            # Standby replicas are not ready until they win the coordinator Lease, so a rolling update would wait
            # forever for a new pod to turn ready while an old one holds the Lease: replace them all at once.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": pod_labels},
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    # The one pod of a deployment with an API token: the gateway elects its coordinator on a Lease.
                    # The ServiceAccount itself does not automount; stage pods never get a token.
                    "serviceAccountName": names.gateway_account,
                    "automountServiceAccountToken": True,
                    "enableServiceLinks": False,
                    "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [container],
                    "volumes": [{"name": "tmp", "emptyDir": {}}],
                },
            },
        },
    }


def gateway_service(owner: Owner) -> Manifest:
    names = Names(owner.name, owner.namespace)
    selector = labels(owner.name, component="gateway")
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": owned_metadata(owner, name=names.gateway, labels=selector),
        "spec": {"selector": selector, "ports": [{"name": "http", "port": GATEWAY_PORT, "targetPort": GATEWAY_PORT}]},
    }


def gateway_ingress(owner: Owner, spec: ModelDeploymentSpec) -> Manifest | None:
    ingress = spec.gateway.ingress
    if ingress is None:
        return None
    names = Names(owner.name, owner.namespace)
    body: Manifest = {
        "rules": [
            {
                "host": ingress.host,
                "http": {
                    "paths": [
                        {
                            "path": "/v1",
                            "pathType": "Prefix",
                            "backend": {"service": {"name": names.gateway, "port": {"number": GATEWAY_PORT}}},
                        }
                    ]
                },
            }
        ]
    }
    if ingress.class_name:
        body["ingressClassName"] = ingress.class_name
    if ingress.tls_secret_name:
        body["tls"] = [{"hosts": [ingress.host], "secretName": ingress.tls_secret_name}]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "Ingress",
        "metadata": owned_metadata(owner, name=names.gateway, labels=labels(owner.name, component="gateway")),
        "spec": body,
    }
