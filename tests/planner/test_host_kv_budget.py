"""spec.kvCache.hostMemory: every stage of the plan reports it beside its resident KV, leaves the GPU plan alone,
reaches the stage pod, and grows the pod's memory request (and a memory limit the user set) by it."""

from __future__ import annotations

from typing import Any

import pytest
from strata.operator.children import Owner, stage_statefulset
from strata.operator.plan_command import to_table
from strata.operator.planner import PlanOptions, plan_placement
from strata.operator.planner.errors import InvalidOptionError
from strata.operator.planning import options_for
from strata.operator.replicas import summarize
from strata.operator.spec import ModelDeploymentSpec
from strata.plan import Plan
from strata_testbed.cluster_objects import gpu_node
from strata_testbed.model_shapes import Q8_0, llama3_70b

SEVENTY_B = llama3_70b(weight_type=Q8_0)
FOUR_A10G = [gpu_node("a10g", gpus=4, gib=24, resource="nvidia.com/gpu")]
GIB = 1 << 30
OWNER = Owner(name="llama", namespace="team-a", uid="0f0e0d0c-0000-4000-8000-000000000001")


def plan(**options: Any) -> Plan:
    return plan_placement(model=SEVENTY_B, nodes=FOUR_A10G, options=PlanOptions(**options))


def spec(**fields: Any) -> ModelDeploymentSpec:
    return ModelDeploymentSpec.from_manifest({"model": {"url": "https://models.example/m.gguf"}, **fields})


def test_every_stage_reports_the_host_tier_and_the_gpu_plan_is_unchanged() -> None:
    without, hosted = plan(), plan(host_kv_bytes=64 * GIB)
    assert hosted.context_length == without.context_length, "host memory is not GPU memory"
    assert [s.kv_bytes for s in hosted.stages] == [s.kv_bytes for s in without.stages]
    assert {s.host_kv_bytes for s in hosted.stages} == {64 * GIB}
    table = to_table(hosted)
    assert "HOST KV GB" in table
    assert f"{64 * GIB / 1e9:.1f}" in table


@pytest.mark.parametrize(
    ("kv_cache", "host_bytes"),
    [
        pytest.param({}, 0, id="unset keeps none"),
        pytest.param({"hostMemory": "64Gi"}, 64 * GIB, id="a binary quantity"),
        pytest.param({"hostMemory": "500M"}, 500_000_000, id="a decimal quantity"),
    ],
)
def test_the_spec_field_becomes_the_plan_option(kv_cache: dict[str, str], host_bytes: int) -> None:
    assert options_for(spec(kvCache=kv_cache)).host_kv_bytes == host_bytes


@pytest.mark.parametrize(
    ("resources", "request_bytes", "limit_bytes"),
    [
        pytest.param({}, 4 * GIB + 8 * GIB, None, id="the default request grows by it"),
        pytest.param(
            {"requests": {"memory": "16Gi"}, "limits": {"memory": "32Gi"}},
            24 * GIB,
            40 * GIB,
            id="a request and a limit the user set both grow by it",
        ),
        pytest.param(
            {"limits": {"memory": "32Gi"}}, 40 * GIB, 40 * GIB, id="a limit alone grows and the request follows it"
        ),
    ],
)
def test_the_stage_pod_is_told_its_host_budget_and_asks_for_the_memory(
    resources: dict[str, Any], request_bytes: int, limit_bytes: int | None
) -> None:
    deployment = spec(kvCache={"hostMemory": "8Gi"}, stage={"resources": resources})
    hosted = plan(host_kv_bytes=options_for(deployment).host_kv_bytes)
    for stage in hosted.stages:
        workload = stage_statefulset(OWNER, deployment, hosted, stage, generation=1, image="strata:test")
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["STRATA_KV_HOST_BYTES"] == str(8 * GIB)
        assert container["resources"]["requests"]["memory"] == str(request_bytes)
        assert container["resources"]["limits"].get("memory") == (None if limit_bytes is None else str(limit_bytes))


def test_without_a_host_tier_the_pod_resources_are_as_before() -> None:
    default = plan()
    workload = stage_statefulset(OWNER, spec(), default, default.stages[0], generation=1, image="strata:test")
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"]["memory"] == "4Gi"


def test_a_negative_host_budget_is_refused() -> None:
    with pytest.raises(InvalidOptionError, match="host KV memory"):
        PlanOptions(host_kv_bytes=-1)


@pytest.mark.parametrize(
    ("kv_cache", "named"),
    [
        pytest.param({"hostMemory": "lots"}, "hostMemory", id="a host memory that is no quantity"),
        pytest.param({"hostMemory": "8Gi", "diskMemory": "1Ti"}, "diskMemory", id="a field the tier does not have"),
    ],
)
def test_the_spec_refuses_what_it_cannot_honour_naming_the_field(kv_cache: dict[str, str], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        spec(kvCache=kv_cache)


def test_the_status_summary_says_resident_and_host_kv_per_stage() -> None:
    hosted = plan(host_kv_bytes=8 * GIB)
    summary = summarize(hosted, generation=1).model_dump(by_alias=True)
    assert [(s["kvBytes"], s["hostKVBytes"]) for s in summary["stages"]] == [
        (s.kv_bytes, 8 * GIB) for s in hosted.stages
    ]
    assert all(s["kvBytes"] > 0 for s in summary["stages"])
