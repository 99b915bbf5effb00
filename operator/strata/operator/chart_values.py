"""The Helm chart's values as one typed model: it generates charts/strata/values.schema.json and the chart's CRD.

Helm validates every install against values.schema.json, so a misspelt key or a wrong type fails at `helm install`
instead of being silently ignored. The schema is generated from this model (every object closed with
`additionalProperties: false`) and the chart's CRD template from strata.operator.crd, so neither can drift from its
source: `python -m strata.operator.chart_values` rewrites both and a test fails when the committed files are stale.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field
from strata.operator.crd import render_crd
from strata.operator.spec_fields import DNS_SUBDOMAIN_PATTERN, QUANTITY_PATTERN

CHART_DIR = Path(__file__).resolve().parents[3] / "charts" / "strata"
SCHEMA_PATH = CHART_DIR / "values.schema.json"
CRD_TEMPLATE_PATH = CHART_DIR / "templates" / "crd-modeldeployments.yaml"

DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class _Values(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Image(_Values):
    repository: str = Field(default="strata", min_length=1, description="Image repository of all three roles.")
    tag: str = Field(default="", description="Image tag; the chart's appVersion when empty.")
    digest: str = Field(default="", pattern=r"^(sha256:[0-9a-f]{64})?$", description="Pins the image; wins over tag.")
    pull_policy: str = Field(
        default="IfNotPresent", alias="pullPolicy", pattern=r"^(Always|IfNotPresent|Never)$", description="Pull policy."
    )


class Crds(_Values):
    enabled: bool = Field(default=True, description="Install the ModelDeployment CRD with the chart.")
    keep: bool = Field(default=True, description="Keep the CRD (and so every ModelDeployment) on helm uninstall.")


class ServiceAccount(_Values):
    create: bool = Field(default=True, description="Create the operator's ServiceAccount.")
    name: str = Field(
        default="", pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)?$", description="Name; generated if empty."
    )
    annotations: dict[str, str] = Field(default_factory=dict, description="Annotations of the ServiceAccount.")


class Resources(_Values):
    requests: dict[str, str] = Field(default_factory=dict, description="Resource requests.")
    limits: dict[str, str] = Field(default_factory=dict, description="Resource limits.")


def _operator_resources() -> Resources:
    return Resources(requests={"cpu": "100m", "memory": "256Mi"}, limits={"memory": "512Mi"})


class Operator(_Values):
    replicas: int = Field(default=1, ge=1, le=5, description="Replicas; one leads through the Lease, the rest wait.")
    lease_name: str = Field(
        default="", alias="leaseName", pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)?$", description="Lease name."
    )
    watch_namespaces: list[str] = Field(
        default_factory=list,
        alias="watchNamespaces",
        description="Namespaces to watch, each with its own Role; empty means every namespace (a ClusterRole).",
    )
    secret_names: list[str] = Field(
        default_factory=list,
        alias="secretNames",
        description="Secrets the operator may read (model tokens named by tokenSecretRef); no other Secret.",
    )
    workload_image: str = Field(
        default="",
        alias="workloadImage",
        description="Image of stage and gateway pods; the chart's image with tag `<tag>-cuda` when empty.",
    )
    json_logs: bool = Field(default=True, alias="jsonLogs", description="Log one JSON object per line.")
    resources: Resources = Field(default_factory=_operator_resources, description="Operator container resources.")
    node_selector: dict[str, str] = Field(default_factory=dict, alias="nodeSelector", description="Node selector.")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="Tolerations of the operator pods.")
    affinity: dict[str, Any] = Field(default_factory=dict, description="Affinity of the operator pods.")
    priority_class_name: str = Field(default="", alias="priorityClassName", description="PriorityClass.")
    pod_labels: dict[str, str] = Field(default_factory=dict, alias="podLabels", description="Extra pod labels.")
    pod_annotations: dict[str, str] = Field(
        default_factory=dict, alias="podAnnotations", description="Extra pod annotations."
    )


class ServiceMonitor(_Values):
    enabled: bool = Field(default=False, description="Create a prometheus-operator ServiceMonitor.")
    interval: str = Field(default="30s", pattern=r"^[0-9]+(ms|s|m|h)$", description="Scrape interval.")
    labels: dict[str, str] = Field(default_factory=dict, description="Labels the Prometheus selects monitors by.")


class Metrics(_Values):
    enabled: bool = Field(default=False, description="Serve Prometheus metrics and create a metrics Service.")
    port: int = Field(default=9402, ge=1024, le=65535, description="Metrics port of the operator container.")
    service_monitor: ServiceMonitor = Field(default_factory=ServiceMonitor, alias="serviceMonitor")


class PodDisruptionBudget(_Values):
    enabled: bool = Field(default=False, description="Create a PodDisruptionBudget for the operator.")
    min_available: int = Field(default=1, alias="minAvailable", ge=0, description="Replicas kept through a drain.")


class KedaExample(_Values):
    """An example KEDA ScaledObject for one ModelDeployment, on its gateway's per-pipeline gauges through Prometheus.

    Off by default: it needs KEDA and a Prometheus that scrapes the gateway. KEDA sets spec.replicas through the
    ModelDeployment's scale subresource, so leave that deployment's spec.autoscaling out (two scalers would fight).
    """

    enabled: bool = Field(default=False, description="Render the ScaledObject (needs KEDA's CRDs in the cluster).")
    deployment: str = Field(
        default="",
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$",
        max_length=63,
        description="ModelDeployment to scale.",
    )
    namespace: str = Field(
        default="",
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$",
        max_length=63,
        description="Its namespace; the release's when empty.",
    )
    min_replicas: int = Field(
        default=1,
        alias="minReplicas",
        ge=0,
        le=64,
        description="Fewest pipelines. 0 leaves the gateway unready at zero: use spec.autoscaling to scale from zero.",
    )
    max_replicas: int = Field(default=4, alias="maxReplicas", ge=1, le=64, description="Most pipelines.")
    prometheus: str = Field(
        default="http://prometheus-operated.monitoring.svc:9090",
        min_length=1,
        description="Address of the Prometheus that scrapes the gateway's /metrics.",
    )
    lanes_per_pipeline: int = Field(
        default=3,
        alias="lanesPerPipeline",
        ge=1,
        le=256,
        description="Busy or queued lanes one pipeline should carry (KEDA asks for their sum over this, rounded up).",
    )
    polling_interval: int = Field(default=15, alias="pollingInterval", ge=1, description="Seconds between queries.")
    cooldown_period: int = Field(
        default=300, alias="cooldownPeriod", ge=0, description="Seconds of low load before KEDA scales down."
    )


class ChartValues(_Values):
    """The root of values.yaml."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, title="strata chart values")

    name_override: str = Field(default="", alias="nameOverride", max_length=63, description="Replaces the chart name.")
    fullname_override: str = Field(
        default="", alias="fullnameOverride", max_length=63, description="Replaces the release-and-chart name."
    )
    image: Image = Field(default_factory=Image)
    image_pull_secrets: list[str] = Field(
        default_factory=list, alias="imagePullSecrets", description="Names of pull Secrets for the operator pods."
    )
    crds: Crds = Field(default_factory=Crds)
    service_account: ServiceAccount = Field(default_factory=ServiceAccount, alias="serviceAccount")
    operator: Operator = Field(default_factory=Operator)
    metrics: Metrics = Field(default_factory=Metrics)
    pod_disruption_budget: PodDisruptionBudget = Field(default_factory=PodDisruptionBudget, alias="podDisruptionBudget")
    keda_example: KedaExample = Field(default_factory=KedaExample, alias="kedaExample")


def _names(pattern: str, max_length: int) -> dict[str, Any]:
    return {"uniqueItems": True, "items": {"type": "string", "pattern": pattern, "maxLength": max_length}}


# Constraints on list items that pydantic cannot attach to `list[str]` without making the Python side awkward.
_ITEM_CONSTRAINTS: dict[tuple[str, ...], dict[str, Any]] = {
    ("operator", "watchNamespaces"): _names(DNS_LABEL_PATTERN, 63),
    ("operator", "secretNames"): _names(DNS_SUBDOMAIN_PATTERN, 253),
    ("imagePullSecrets",): _names(DNS_SUBDOMAIN_PATTERN, 253),
}
_QUANTITY = {"type": "string", "pattern": QUANTITY_PATTERN}


def _inline(node: Any, defs: dict[str, Any], path: tuple[str, ...]) -> Any:
    """Replace $ref by the definition and drop titles, so the schema reads top to bottom like values.yaml."""
    if isinstance(node, list):
        return [_inline(item, defs, path) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        return _inline({**target, **{k: v for k, v in node.items() if k != "$ref"}}, defs, path)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("title", "$defs"):
            continue
        if key == "properties":
            out[key] = {
                name: _inline(prop, defs, (*path, name)) | _ITEM_CONSTRAINTS.get((*path, name), {})
                for name, prop in value.items()
            }
        else:
            out[key] = _inline(value, defs, path)
    if path[-1:] in (("requests",), ("limits",)) and out.get("type") == "object":
        out["additionalProperties"] = _QUANTITY
    return out


def render_schema() -> dict[str, Any]:
    schema = ChartValues.model_json_schema(by_alias=True, mode="serialization")
    body = _inline(schema, schema.get("$defs", {}), ())
    return {"$schema": "https://json-schema.org/draft-07/schema#", "title": "strata chart values", **body}


def render_schema_json() -> str:
    return json.dumps(render_schema(), indent=2) + "\n"


def render_crd_template() -> str:
    """The generated CRD behind `crds.enabled`, annotated to survive `helm uninstall` while `crds.keep` is set."""
    crd = render_crd()
    spec = yaml.safe_dump({"spec": crd["spec"]}, sort_keys=False, width=120)
    return (
        "# Generated by `python -m strata.operator.chart_values` from strata/operator/spec.py; do not edit.\n"
        "{{- if .Values.crds.enabled }}\n"
        f"apiVersion: {crd['apiVersion']}\n"
        f"kind: {crd['kind']}\n"
        "metadata:\n"
        f"  name: {crd['metadata']['name']}\n"
        "  labels:\n"
        '    {{- include "strata.labels" . | nindent 4 }}\n'
        "  {{- if .Values.crds.keep }}\n"
        "  annotations:\n"
        "    helm.sh/resource-policy: keep\n"
        "  {{- end }}\n"
        f"{spec}"
        "{{- end }}\n"
    )


def main() -> int:
    SCHEMA_PATH.write_text(render_schema_json())
    CRD_TEMPLATE_PATH.parent.mkdir(parents=True, exist_ok=True)
    CRD_TEMPLATE_PATH.write_text(render_crd_template())
    print(f"wrote {SCHEMA_PATH} and {CRD_TEMPLATE_PATH}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
