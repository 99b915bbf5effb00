"""Every bad input a user can give a ModelDeployment shows in its status within 10 s, on the real control plane.

For each cause (an unreadable model by cause, a token Secret missing or wrong, a gated `hf://` answer, a model the
stages cannot run, no usable GPU) the table checks a new deployment (phase, Planned's status, reason and
observedGeneration, the reason column, one Event), then the same change applied to a deployment that is Ready (the
phase ChangeRefused, a message naming the generation that cannot be applied and the one that keeps serving), then
the change undone (Ready again). The operator runs as its own process with HF_ENDPOINT at a local server that
refuses as Hugging Face does.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config
from strata.gguf.testmodels.shapes import LARGE_SHAPES
from strata.gguf.testmodels.writer import write_header_only_model
from strata.operator.backoff import FIRST_DELAY_SECONDS
from strata.operator.crd import render_crd
from strata.operator.spec import GROUP, PLURAL, VERSION
from strata_testbed.bad_models import closed_port, serve_refusals, write_bad_headers
from strata_testbed.controlplane import ControlPlane
from strata_testbed.operator_run import OperatorProcess
from strata_testbed.range_server import serve_directory
from strata_testbed.waiting import establish_crd, eventually

pytestmark = pytest.mark.cluster

SEEN_WITHIN_SECONDS = 10.0
STEADY = "steady"


@dataclass(frozen=True)
class Bed:
    api: client.ApiClient
    namespace: str
    refusals: str
    no_range: str
    files: dict[str, Path]
    good: dict[str, Any]  # the steady deployment's spec


@pytest.fixture(scope="module")
def bed(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    folder = tmp_path_factory.mktemp("status-truth")
    model = write_header_only_model(folder / "llama3-70b.gguf", shape="llama3-70b").path
    files = write_bad_headers(folder, whole=model)
    falcon = dataclasses.replace(LARGE_SHAPES["llama3-8b"], architecture="falcon", block_count=4)
    files["falcon"] = write_header_only_model(folder / "falcon.gguf", shape=falcon).path
    api = config.new_client_from_config(config_file=str(control_plane.kubeconfig))
    establish_crd(api, render_crd())
    core = client.CoreV1Api(api)
    namespace = f"truth-{uuid.uuid4().hex[:6]}"
    core.create_namespace(body={"metadata": {"name": namespace}})
    core.create_namespaced_secret(
        namespace=namespace, body={"metadata": {"name": "hf-token"}, "stringData": {"token": "hf_wrong"}}
    )
    with serve_refusals() as refusals, serve_directory(folder, ranges=False) as no_range:
        operator = OperatorProcess(
            control_plane.kubeconfig, namespace, folder / "operator.log", env={"HF_ENDPOINT": refusals}
        )
        operator.start()
        try:
            yield Bed(
                api, namespace, refusals, no_range.url, files, {"model": {"url": model.as_uri()}, "context": 8192}
            )
        finally:
            operator.stop()
            print((folder / "operator.log").read_text(errors="replace")[-6000:])  # shown when a test fails
            core.delete_namespace(name=namespace)
            api.close()


def custom(bed: Bed) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(bed.api)


def read(bed: Bed, name: str) -> dict[str, Any]:
    return dict(custom(bed).get_namespaced_custom_object(GROUP, VERSION, bed.namespace, PLURAL, name))


def planned(body: dict[str, Any]) -> dict[str, Any]:
    found = [c for c in (body.get("status") or {}).get("conditions", []) if c["type"] == "Planned"]
    return dict(found[0]) if found else {}


def events(bed: Bed, name: str, reason: str) -> list[client.CoreV1Event]:
    found = client.CoreV1Api(bed.api).list_namespaced_event(namespace=bed.namespace).items
    return [e for e in found if e.involved_object.name == name and e.reason == reason]


def seen(bed: Bed, name: str, *, phase: str, reason: str, generation: int) -> dict[str, Any]:
    """The deployment once its status shows `phase` with Planned's `reason` for spec `generation`, within 10 s."""

    def shows() -> dict[str, Any] | None:
        body = read(bed, name)
        status = body.get("status") or {}
        done = status.get("observedGeneration") == generation and status.get("phase") == phase
        return body if done and planned(body).get("reason") == reason else None

    return eventually(shows, timeout=SEEN_WITHIN_SECONDS, what=f"{name}: phase {phase}, Planned {reason} @{generation}")


@dataclass(frozen=True)
class Row:
    spec: Callable[[Bed], dict[str, Any]]  # merged into the good spec (None removes a field)
    reason: str
    said: str  # in Planned's message
    fresh_phase: str = "Failed"  # of a new deployment with this spec
    retried: bool = True
    event: str = ""  # the Event's reason when it is not the condition's


def model(url: Callable[[Bed], str], secret: str | None = None) -> Callable[[Bed], dict[str, Any]]:
    ref = {"name": secret} if secret else None
    return lambda bed: {"model": {"url": url(bed), "tokenSecretRef": ref}}


ROWS = {
    "a URL that 404s": Row(model(lambda b: f"{b.refusals}/missing.gguf"), "ModelNotFound", "no such file (HTTP 404"),
    "a token the server refuses": Row(
        model(lambda b: "hf://org/private/model.gguf", "hf-token"), "ModelAccessDenied", "refused the token"
    ),
    "a token Secret that does not exist": Row(
        model(lambda b: "hf://org/private/model.gguf", "absent"), "TokenSecretUnreadable", "absent does not exist"
    ),
    "a gated hf:// repository": Row(
        model(lambda b: "hf://org/gated/model.gguf", "hf-token"), "ModelGated", "the repository is gated"
    ),
    "a host that refuses connections": Row(
        model(lambda b: f"http://127.0.0.1:{closed_port()}/m.gguf"), "ModelUnreachable", "refused the connection"
    ),
    "a host name that does not resolve": Row(
        model(lambda b: "http://strata-no-such-host.invalid/m.gguf"), "ModelUnreachable", "does not resolve"
    ),
    "TLS to a server that does not speak it": Row(
        model(lambda b: b.refusals.replace("http:", "https:") + "/m.gguf"), "ModelTLSFailed", "TLS handshake"
    ),
    "a server that ignores Range": Row(
        model(lambda b: f"{b.no_range}/llama3-70b.gguf"), "ModelRangeIgnored", "ignored the Range request"
    ),
    "a file that is not GGUF": Row(model(lambda b: b.files["not-gguf"].as_uri()), "ModelNotGGUF", "magic at byte 0"),
    "a file cut inside its header": Row(
        model(lambda b: b.files["truncated"].as_uri()), "ModelHeaderTruncated", "at byte"
    ),
    "a header claiming 2^60 tensors": Row(
        model(lambda b: b.files["hostile"].as_uri()), "ModelHeaderInvalid", "tensor_count at byte 8"
    ),
    "an architecture the stages do not run": Row(
        model(lambda b: b.files["falcon"].as_uri()), "ModelNotExecutable", "'falcon' is not one", retried=False
    ),
    "zero usable GPUs": Row(
        lambda b: {"placement": {"nodeSelector": {"strata.dev/no-such-pool": "x"}}},
        "NoPlanFits",
        "short by",
        fresh_phase="Shortfall",
        retried=False,
        event="CapacityShortfall",
    ),
}


def merged(base: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    """`base` with `change` applied as a JSON merge patch applies it (None deletes)."""
    result = dict(base)
    for key, value in change.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merged(result[key], value)
        else:
            result[key] = value
    return result


def undo(change: dict[str, Any], good: dict[str, Any]) -> dict[str, Any]:
    """The merge patch that puts back `good` where `change` differs from it."""
    return {
        key: undo(value, good.get(key) or {}) if isinstance(value, dict) and key in good else good.get(key)
        for key, value in change.items()
    }


@pytest.fixture(scope="module")
def steady(bed: Bed) -> dict[str, Any]:
    """A deployment that is Ready on the kwok pool, the starting point of every refused change."""
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ModelDeployment", "metadata": {"name": STEADY}}
    custom(bed).create_namespaced_custom_object(GROUP, VERSION, bed.namespace, PLURAL, {**body, "spec": bed.good})
    return eventually(
        lambda: (lambda b: b if (b.get("status") or {}).get("phase") == "Ready" else None)(read(bed, STEADY)),
        timeout=120,
        what="the steady deployment Ready",
    )


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
def test_a_bad_input_shows_in_the_status_and_a_change_to_it_is_refused_visibly(
    bed: Bed, steady: dict[str, Any], row: Row
) -> None:
    change = row.spec(bed)
    name = f"bad-{uuid.uuid4().hex[:6]}"
    manifest = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ModelDeployment", "metadata": {"name": name}}
    created = time.monotonic()
    custom(bed).create_namespaced_custom_object(
        GROUP, VERSION, bed.namespace, PLURAL, {**manifest, "spec": merged(bed.good, change)}
    )
    fresh = seen(bed, name, phase=row.fresh_phase, reason=row.reason, generation=1)
    condition = planned(fresh)
    assert (condition["status"], condition["observedGeneration"]) == ("False", 1)
    assert row.said in condition["message"]
    assert fresh["status"]["reason"] == row.reason
    assert fresh["status"]["modelName"]
    assert ("reading it again in" in condition["message"]) == row.retried
    # One Event for the cause, its count bounded by the back-off: attempts at 0, 2, 6, 14 ... seconds.
    event = row.event or row.reason
    recorded = eventually(lambda: events(bed, name, event), timeout=SEEN_WITHIN_SECONDS, what="an Event")
    elapsed = time.monotonic() - created
    assert len(recorded) == 1
    assert recorded[0].type == "Warning"
    assert (recorded[0].count or 1) <= 2 + math.log2(1 + elapsed / FIRST_DELAY_SECONDS)

    serving = read(bed, STEADY)["status"]["serving"]
    refused = custom(bed).patch_namespaced_custom_object(
        GROUP, VERSION, bed.namespace, PLURAL, STEADY, {"spec": change}
    )
    generation = refused["metadata"]["generation"]
    body = seen(bed, STEADY, phase="ChangeRefused", reason=row.reason, generation=generation)
    message = planned(body)["message"]
    assert f"generation {generation} cannot be applied: " in message
    assert f"generation {serving['specGeneration']} keeps serving" in message
    assert body["status"]["serving"] == serving
    assert body["status"]["reason"] == row.reason
    assert eventually(lambda: events(bed, STEADY, event), timeout=SEEN_WITHIN_SECONDS, what="an Event")

    fixed = custom(bed).patch_namespaced_custom_object(
        GROUP, VERSION, bed.namespace, PLURAL, STEADY, {"spec": undo(change, bed.good)}
    )
    back = seen(bed, STEADY, phase="Ready", reason="Planned", generation=fixed["metadata"]["generation"])
    assert planned(back)["status"] == "True"
    assert back["status"]["serving"]["generation"] == serving["generation"]
