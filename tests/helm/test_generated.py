"""The chart's generated files match their sources, and values.yaml is the typed model's defaults, documented."""

from __future__ import annotations

import pytest
import yaml
from pydantic import BaseModel
from strata.operator.chart_values import (
    CHART_DIR,
    CRD_TEMPLATE_PATH,
    SCHEMA_PATH,
    ChartValues,
    render_crd_template,
    render_schema_json,
)
from strata.operator.crd import CRD_PATH
from strata_testbed.helm import Helm, find

VALUES_PATH = CHART_DIR / "values.yaml"


def test_the_committed_values_schema_is_what_the_model_generates() -> None:
    assert SCHEMA_PATH.read_text() == render_schema_json(), "stale: run `python -m strata.operator.chart_values`"


def test_the_committed_crd_template_is_what_the_spec_generates() -> None:
    assert CRD_TEMPLATE_PATH.read_text() == render_crd_template(), "stale: run `python -m strata.operator.chart_values`"


def test_the_chart_installs_the_same_crd_as_crds_folder() -> None:
    rendered = find(Helm.pinned().manifests(), "CustomResourceDefinition")
    committed = yaml.safe_load(CRD_PATH.read_text())
    assert len(rendered) == 1
    assert rendered[0]["spec"] == committed["spec"]
    assert rendered[0]["metadata"]["name"] == committed["metadata"]["name"]


def test_values_yaml_holds_exactly_the_model_defaults() -> None:
    written = yaml.safe_load(VALUES_PATH.read_text())
    assert ChartValues.model_validate(written) == ChartValues()
    assert written == ChartValues().model_dump(by_alias=True)


def _options(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every setting of the values model by its values.yaml path; free-form maps (labels, requests) are one setting."""
    keys = []
    for name, info in model.model_fields.items():
        key = f"{prefix}{info.alias or name}"
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            keys += _options(info.annotation, f"{key}.")
        else:
            keys.append(key)
    return keys


@pytest.mark.parametrize("key", _options(ChartValues), ids=lambda key: f"{key} has a comment above it")
def test_every_value_is_documented(key: str) -> None:
    lines = VALUES_PATH.read_text().splitlines()
    leaf = key.rsplit(".", 1)[-1]
    depth = key.count(".")
    candidates = [i for i, line in enumerate(lines) if line.startswith("  " * depth + f"{leaf}:")]
    assert candidates, f"{key} not found in values.yaml"
    assert any(lines[i - 1].strip().startswith("#") for i in candidates), f"{key} has no comment"
