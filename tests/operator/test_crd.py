"""The CRD is generated from the typed spec, and the real API server refuses bad manifests field by field."""

from __future__ import annotations

import copy
import uuid
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from strata.operator.crd import CRD_PATH, render_crd, render_yaml
from strata.operator.reference import README, with_reference
from strata.operator.spec import GROUP, PLURAL, VERSION, ModelDeploymentSpec
from strata.operator.speculative_env import speculative_env
from strata_testbed.waiting import establish_crd

VALID: dict[str, Any] = {
    "apiVersion": f"{GROUP}/{VERSION}",
    "kind": "ModelDeployment",
    "metadata": {"name": "tiny"},
    "spec": {
        "model": {"url": "hf://acme/tiny-llama-GGUF/tiny-llama.Q8_0.gguf@main"},
        "context": 4096,
        "parallel": 4,
        "cacheTypeK": "q8_0",
        "placement": {"maxStages": 2, "tolerations": [{"key": "dedicated", "operator": "Exists"}]},
        "gateway": {"ingress": {"host": "tiny.example.com", "className": "nginx"}},
    },
}


def test_the_committed_crd_is_what_the_spec_generates() -> None:
    assert CRD_PATH.read_text() == render_yaml(), "crds/ is stale: run `python -m strata.operator.crd`"


def test_the_readmes_configuration_reference_is_what_the_spec_generates() -> None:
    assert README.read_text() == with_reference(README.read_text()), "README.md is stale: run `make crds`"


@pytest.mark.parametrize(
    ("autoscaling", "problem"),
    [
        pytest.param({"minReplicas": 3, "maxReplicas": 2}, "minReplicas <= maxReplicas", id="bounds out of order"),
        pytest.param({"maxReplicas": 2, "targetQueue": 1}, "targetQueue", id="an unknown field, by name"),
        pytest.param({"maxReplicas": 2, "coldStartWaitSeconds": 0}, "coldStartWaitSeconds", id="no cold-start bound"),
    ],
)
def test_the_handlers_model_refuses_autoscaling_the_api_server_would(autoscaling: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        ModelDeploymentSpec.from_manifest({**VALID["spec"], "autoscaling": autoscaling})


def test_autoscaling_defaults_to_a_five_minute_idle_delay_and_a_minute_of_cold_start() -> None:
    spec = ModelDeploymentSpec.from_manifest({**VALID["spec"], "autoscaling": {"minReplicas": 0, "maxReplicas": 2}})
    assert spec.autoscaling is not None
    assert (spec.autoscaling.scale_down_delay_seconds, spec.autoscaling.cold_start_wait_seconds) == (300, 60.0)


def test_the_valid_example_parses_with_the_handlers_model() -> None:
    spec = ModelDeploymentSpec.from_manifest(VALID["spec"])
    assert spec.parallel == 4
    assert spec.placement.headroom_percent == 10


DRAFT_MODEL = {"url": "hf://org/small/small.gguf"}
SPECULATIVE_REFUSALS = {
    "draft bounds out of order": ({"method": "ngram", "minDraft": 5, "maxDraft": 2}, "minDraft <= maxDraft"),
    "the draft method without a draft model": ({"method": "draft"}, "draftModel is required with method draft"),
    "a draft model with n-gram lookup": ({"method": "ngram", "draftModel": DRAFT_MODEL}, "applies to it only"),
    "a probability floor with n-gram lookup": ({"method": "ngram", "pMin": 0.5}, "pMin applies to method draft only"),
    "a probability floor above 1": ({"method": "draft", "draftModel": DRAFT_MODEL, "pMin": 1.5}, "pMin"),
    "a position dearer than a whole step": ({"method": "ngram", "positionCost": 1.5}, "positionCost"),
    "a negative position cost": ({"method": "ngram", "positionCost": -0.1}, "positionCost"),
    "a draft token Secret over plain http": (
        {"method": "draft", "draftModel": {"url": "http://m.svc/d.gguf", "tokenSecretRef": {"name": "t"}}},
        "tokenSecretRef applies to https:// and hf:// sources only",
    ),
}


@pytest.mark.parametrize(("speculative", "problem"), SPECULATIVE_REFUSALS.values(), ids=SPECULATIVE_REFUSALS.keys())
def test_the_handlers_refuse_speculative_settings_the_api_server_would(
    speculative: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        ModelDeploymentSpec.from_manifest(_with("spec.speculative", speculative)["spec"])


def test_the_draft_method_takes_its_draft_model_as_the_model_is_given() -> None:
    speculative = {"method": "draft", "draftModel": {**DRAFT_MODEL, "tokenSecretRef": {"name": "hf"}}, "pMin": 0.2}
    spec = ModelDeploymentSpec.from_manifest(_with("spec.speculative", speculative)["spec"])
    assert spec.speculative is not None
    assert spec.speculative.draft_model is not None
    assert (spec.speculative.draft_model.url, spec.speculative.p_min) == (DRAFT_MODEL["url"], 0.2)


ENVIRONMENTS = {
    "off": (None, {}),
    "n-gram lookup with the defaults": (
        {"method": "ngram"}, {"STRATA_SPECULATIVE": "ngram", "STRATA_MAX_DRAFT": "4", "STRATA_MIN_DRAFT": "1"}
    ),
    "n-gram lookup with its bounds and a position cost": (
        {"method": "ngram", "maxDraft": 8, "minDraft": 2, "positionCost": 0.02},
        {
            "STRATA_SPECULATIVE": "ngram", "STRATA_MAX_DRAFT": "8", "STRATA_MIN_DRAFT": "2",
            "STRATA_POSITION_COST": "0.02",
        },
    ),
    "a draft model with its floor": (
        {"method": "draft", "draftModel": DRAFT_MODEL, "pMin": 0.2},
        {
            "STRATA_SPECULATIVE": "draft", "STRATA_MAX_DRAFT": "4", "STRATA_MIN_DRAFT": "1",
            "STRATA_DRAFT_MODEL_URL": DRAFT_MODEL["url"], "STRATA_P_MIN": "0.2",
        },
    ),
}  # fmt: skip


@pytest.mark.parametrize(("speculative", "environment"), ENVIRONMENTS.values(), ids=ENVIRONMENTS.keys())
def test_the_gateway_environment_carries_every_speculative_setting(
    speculative: dict[str, Any] | None, environment: dict[str, str]
) -> None:
    spec = ModelDeploymentSpec.from_manifest(_with("spec.speculative", speculative)["spec"]) if speculative else None
    env = speculative_env(spec.speculative if spec is not None else None)
    assert {e["name"]: e.get("value") for e in env} == environment


@pytest.fixture(scope="module")
def crd_installed(control_plane: Any) -> None:
    from kubernetes import config

    api = config.new_client_from_config(config_file=str(control_plane.kubeconfig))
    establish_crd(api, render_crd())
    api.close()


def _with(path: str, value: Any) -> dict[str, Any]:
    manifest = copy.deepcopy(VALID)
    target = manifest
    keys = path.split(".")
    for key in keys[:-1]:
        target = target.setdefault(key, {})
    target[keys[-1]] = value
    return manifest


INVALID = [
    pytest.param(_with("spec.model.url", "ftp://host/model.gguf"), "spec.model.url", id="an ftp URL is refused"),
    pytest.param(_with("spec.model.url", "http://host/model"), "spec.model.url", id="a URL without a file is refused"),
    pytest.param(_with("spec.model.url", "https://host/model.bin"), "spec.model.url", id="a non-GGUF file is refused"),
    pytest.param(_with("spec.context", -1), "spec.context", id="a negative context is refused"),
    pytest.param(_with("spec.context", 5000), "spec.context", id="a context off the 256-cell grid is refused"),
    pytest.param(_with("spec.cacheTypeK", "q3_k"), "spec.cacheTypeK", id="an unknown cache type is refused"),
    pytest.param(_with("spec.parallel", 0), "spec.parallel", id="zero parallel slots are refused"),
    pytest.param(
        _with("spec.model", {"url": "file:///models/tiny.gguf", "tokenSecretRef": {"name": "hf-token"}}),
        "spec.model.tokenSecretRef",
        id="a token Secret with a local file is contradictory",
    ),
    pytest.param(
        _with("spec.model", {"url": "http://models.svc/tiny.gguf", "tokenSecretRef": {"name": "hf-token"}}),
        "spec.model.tokenSecretRef",
        id="a token Secret over plain http is refused",
    ),
    pytest.param(_with("spec.parallel", 32), "spec.context", id="more slots than the context can give 256 cells each"),
    pytest.param(_with("spec.placement.maxStages", 0), "spec.placement.maxStages", id="zero stages are refused"),
    pytest.param(
        _with("spec.placement.headroomPercent", 95),
        "spec.placement.headroomPercent",
        id="headroom above 90% is refused",
    ),
    pytest.param(_with("spec.placement.gpuMemory", "lots"), "spec.placement.gpuMemory", id="a non-quantity is refused"),
    pytest.param(_with("spec.admission.maxWaitSeconds", 0), "spec.admission.maxWaitSeconds", id="zero wait refused"),
    pytest.param(_with("spec.gateway.replicas", 0), "spec.gateway.replicas", id="zero gateway replicas are refused"),
    pytest.param(
        _with("spec.placement.tolerations", [{"operator": "Sometimes"}]),
        "spec.placement.tolerations[0].operator",
        id="an unknown toleration operator is refused",
    ),
    pytest.param(_with("spec.pipelines", 3), "pipelines", id="an unknown field is refused"),
    pytest.param(_with("spec.replicas", -1), "spec.replicas", id="negative pipelines are refused"),
    pytest.param(
        _with("spec.autoscaling", {"minReplicas": 3, "maxReplicas": 2}),
        "autoscaling needs minReplicas",  # the API server's JSON escapes the rule's "<="
        id="autoscaling bounds out of order are refused",
    ),
    pytest.param(_with("spec.autoscaling", {"minReplicas": 0}), "maxReplicas", id="autoscaling needs a maximum"),
    pytest.param(
        _with("spec.autoscaling", {"maxReplicas": 2, "targetQueue": 1}),
        "targetQueue",
        id="an unknown autoscaling field is refused",
    ),
    pytest.param(_with("spec.rollout.maxUnavailable", 0), "spec.rollout.maxUnavailable", id="a rollout must move"),
    pytest.param({**VALID, "spec": {"parallel": 2}}, "spec.model", id="a manifest without a model is refused"),
    pytest.param(
        _with("spec.speculative", {"method": "draft"}),
        "spec.speculative.draftModel",
        id="the draft method without a draft model is refused",
    ),
    pytest.param(
        _with("spec.speculative", {"method": "ngram", "pMin": 0.5}),
        "spec.speculative.pMin",
        id="a probability floor with n-gram lookup is refused",
    ),
    pytest.param(
        _with(
            "spec.speculative",
            {"method": "draft", "draftModel": {"url": "http://m.svc/d.gguf", "tokenSecretRef": {"name": "t"}}},
        ),
        "spec.speculative.draftModel.tokenSecretRef",
        id="a draft token Secret over plain http is refused",
    ),
    pytest.param(
        _with("spec.speculative", {"method": "eagle"}), "spec.speculative.method", id="a drafter not built is refused"
    ),
    pytest.param(
        _with("spec.speculative", {"method": "ngram", "minDraft": 5, "maxDraft": 2}),
        "minDraft must not exceed maxDraft",
        id="a minimum draft above the maximum is refused",
    ),
]


@pytest.mark.cluster
@pytest.mark.usefixtures("crd_installed")
@pytest.mark.parametrize(("manifest", "field"), INVALID)
def test_the_api_server_refuses_an_invalid_manifest_naming_the_field(
    api_client: client.ApiClient, manifest: dict[str, Any], field: str
) -> None:
    objects = client.CustomObjectsApi(api_client)
    body = copy.deepcopy(manifest)
    body["metadata"] = {"name": f"bad-{uuid.uuid4().hex[:6]}"}
    with pytest.raises(ApiException) as refused:
        objects.create_namespaced_custom_object(
            group=GROUP, version=VERSION, namespace="default", plural=PLURAL, body=body, field_validation="Strict"
        )
    assert refused.value.status in (400, 422)
    assert field in str(refused.value.body)


@pytest.mark.cluster
@pytest.mark.usefixtures("crd_installed")
def test_the_api_server_accepts_the_valid_example_and_applies_defaults(api_client: client.ApiClient) -> None:
    objects = client.CustomObjectsApi(api_client)
    body = copy.deepcopy(VALID)
    body["metadata"] = {"name": f"ok-{uuid.uuid4().hex[:6]}"}
    created = objects.create_namespaced_custom_object(
        group=GROUP, version=VERSION, namespace="default", plural=PLURAL, body=body, field_validation="Strict"
    )
    assert created["spec"]["cacheTypeV"] == "q8_0"
    assert created["spec"]["model"]["url"] == VALID["spec"]["model"]["url"]


@pytest.mark.cluster
@pytest.mark.usefixtures("crd_installed")
def test_kubectl_scale_sets_spec_replicas_through_the_scale_subresource(api_client: client.ApiClient) -> None:
    objects = client.CustomObjectsApi(api_client)
    name = f"scaled-{uuid.uuid4().hex[:6]}"
    body = copy.deepcopy(VALID) | {"metadata": {"name": name}}
    created = objects.create_namespaced_custom_object(
        group=GROUP, version=VERSION, namespace="default", plural=PLURAL, body=body, field_validation="Strict"
    )
    assert created["spec"]["replicas"] == 1
    where = {"group": GROUP, "version": VERSION, "namespace": "default", "plural": PLURAL, "name": name}
    objects.patch_namespaced_custom_object_status(
        **where, body={"status": {"replicas": 1, "selector": "app.kubernetes.io/component=stage"}}
    )
    scale = objects.patch_namespaced_custom_object_scale(**where, body={"spec": {"replicas": 3}})
    assert scale["spec"]["replicas"] == 3
    assert scale["status"] == {"replicas": 1, "selector": "app.kubernetes.io/component=stage"}
    assert objects.get_namespaced_custom_object(**where)["spec"]["replicas"] == 3


# Whole numbers that a CEL rule reads, written with a decimal point: they once failed the rule ("expected int, got
# float64") though the schema's own check passed them.
WHOLE_WITH_A_POINT = [
    pytest.param("spec.coordination", {"retryPeriodSeconds": 1.0}, id="a retry period written as 1.0"),
    pytest.param("spec.coordination", {"renewDeadlineSeconds": 10.0}, id="a renew deadline written as 10.0"),
    pytest.param("spec.coordination", {"leaseDurationSeconds": 15.0}, id="a lease duration written as 15.0"),
    pytest.param("spec.autoscaling", {"minReplicas": 0.0, "maxReplicas": 2.0}, id="autoscaling bounds as 0.0 and 2.0"),
    pytest.param("spec.speculative", {"method": "ngram", "maxDraft": 4.0}, id="a maximum draft written as 4.0"),
]


@pytest.mark.cluster
@pytest.mark.usefixtures("crd_installed")
@pytest.mark.parametrize(("path", "fields"), WHOLE_WITH_A_POINT)
def test_the_api_server_accepts_whole_numbers_written_with_a_decimal_point(
    api_client: client.ApiClient, path: str, fields: dict[str, Any]
) -> None:
    objects = client.CustomObjectsApi(api_client)
    body = _with(path, fields)
    body["metadata"] = {"name": f"ok-{uuid.uuid4().hex[:6]}"}
    created = objects.create_namespaced_custom_object(
        group=GROUP, version=VERSION, namespace="default", plural=PLURAL, body=body, field_validation="Strict"
    )
    section = created["spec"][path.removeprefix("spec.")]
    assert {k: section[k] for k in fields} == fields


@pytest.mark.parametrize(("path", "fields"), WHOLE_WITH_A_POINT)
def test_the_handlers_model_takes_whole_numbers_written_with_a_decimal_point_as_ints(
    path: str, fields: dict[str, Any]
) -> None:
    spec = ModelDeploymentSpec.from_manifest(_with(path, fields)["spec"])
    section = getattr(spec, path.removeprefix("spec."))
    values = section.model_dump(by_alias=True)
    assert all(values[k] == v and isinstance(values[k], int) for k, v in fields.items() if k != "method")


@pytest.mark.cluster
@pytest.mark.usefixtures("crd_installed")
@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        pytest.param({"retryPeriodSeconds": 1.5}, "retryPeriodSeconds", id="a fractional retry period is refused"),
        pytest.param(
            {"retryPeriodSeconds": 5.0, "renewDeadlineSeconds": 4.0},
            "coordination needs retryPeriodSeconds",
            id="the order rule still holds for numbers with a point",
        ),
    ],
)
def test_the_api_server_still_refuses_coordination_seconds_out_of_rule(
    api_client: client.ApiClient, fields: dict[str, float], problem: str
) -> None:
    objects = client.CustomObjectsApi(api_client)
    body = _with("spec.coordination", fields)
    body["metadata"] = {"name": f"bad-{uuid.uuid4().hex[:6]}"}
    with pytest.raises(ApiException) as refused:
        objects.create_namespaced_custom_object(
            group=GROUP, version=VERSION, namespace="default", plural=PLURAL, body=body, field_validation="Strict"
        )
    assert refused.value.status in (400, 422)
    assert problem in str(refused.value.body)
    assert "expected int" not in str(refused.value.body), "the rule ran, rather than failing on the number's type"
