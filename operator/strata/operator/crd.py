"""Generates the ModelDeployment CRD from the typed spec, so the API server enforces what the handlers assume.

pydantic writes JSON Schema 2020-12; Kubernetes wants a structural OpenAPI v3 subset: no $ref, no anyOf for
optionals, boolean exclusive bounds, no titles. `python -m strata.operator.crd` rewrites crds/; a test fails when
the committed file differs from what this module generates.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml
from strata.operator.spec import GROUP, KIND, PLURAL, VERSION, ModelDeploymentSpec
from strata.operator.status import ModelDeploymentStatus

CRD_PATH = Path(__file__).resolve().parents[3] / "crds" / f"{PLURAL}.{GROUP}.yaml"
_DROPPED_KEYS = {"title"}


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_structural(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _structural(merged, defs)
    if "anyOf" in node:
        # Optional[X] is written as anyOf [X, null]: optional fields are simply not required in OpenAPI.
        choices = [c for c in node["anyOf"] if c.get("type") != "null"]
        if len(choices) != 1:
            raise ValueError(f"cannot express a union of {len(choices)} types structurally: {node['anyOf']}")
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        return _structural({**choices[0], **rest}, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED_KEYS or key == "$defs":
            continue
        if key == "default" and value is None:
            continue
        if key == "additionalProperties" and value is False:
            # Structural schemas forbid it; the API server's strict field validation refuses unknown fields.
            continue
        if key == "properties":
            out[key] = {name: _structural(prop, defs) for name, prop in value.items()}
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        else:
            out[key] = _structural(value, defs)
    return out


def openapi_schema(model: type[Any]) -> dict[str, Any]:
    schema = model.model_json_schema(by_alias=True, mode="validation")
    return dict(_structural(schema, schema.get("$defs", {})))


def render_crd() -> dict[str, Any]:
    status = openapi_schema(ModelDeploymentStatus)
    status["properties"]["conditions"]["x-kubernetes-list-type"] = "map"
    status["properties"]["conditions"]["x-kubernetes-list-map-keys"] = ["type"]
    columns = [
        ("Model", "string", ".status.modelName"),
        ("Stages", "integer", ".status.stageCount"),
        ("Context", "integer", ".status.contextLength"),
        ("Ready", "string", ".status.ready"),
        ("Pipelines", "string", ".status.pipelinesReady"),
        ("Phase", "string", ".status.phase"),
        ("Reason", "string", ".status.reason"),
        ("Age", "date", ".metadata.creationTimestamp"),
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "plural": PLURAL,
                "singular": KIND.lower(),
                "listKind": f"{KIND}List",
                "shortNames": ["mdep"],
                "categories": ["strata"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    # `kubectl scale`, a HorizontalPodAutoscaler and KEDA set spec.replicas through this.
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": [
                        {"name": name, "type": kind, "jsonPath": path} for name, kind, path in columns
                    ],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A GGUF model served across a GPU node pool as a pipeline of stages.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": openapi_schema(ModelDeploymentSpec),
                                "status": status,
                            },
                        }
                    },
                }
            ],
        },
    }


def render_yaml() -> str:
    header = "# Generated by `python -m strata.operator.crd` from strata/operator/spec.py; do not edit.\n"
    return header + yaml.safe_dump(render_crd(), sort_keys=False, width=120)


def main() -> int:
    CRD_PATH.parent.mkdir(parents=True, exist_ok=True)
    CRD_PATH.write_text(render_yaml())
    print(f"wrote {CRD_PATH}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
