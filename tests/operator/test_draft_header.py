"""The reconciler reads the draft model's header (its weights and KV size the gateway pod, strata.draft_memory):
none without the draft method, the draft's ModelInfo with it, and a draft it cannot read refused with a message
that says it is the draft."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
from strata.gguf.testmodels import write_test_model
from strata.operator.kube import Cluster
from strata.operator.models import ModelCache, ModelUnreadable
from strata.operator.reasons import Reason
from strata.operator.reconcile import Reconciler
from strata.operator.spec import ModelDeploymentSpec


def reconciler() -> Reconciler:
    # No token Secret is named, so the cluster is never asked for one.
    return Reconciler(
        cluster=cast(Cluster, object()), models=ModelCache(), image="strata:dev", operator_namespace="ops"
    )


def spec(speculative: dict[str, Any] | None) -> ModelDeploymentSpec:
    manifest: dict[str, Any] = {"model": {"url": "hf://org/big/big.gguf"}}
    if speculative is not None:
        manifest["speculative"] = speculative
    return ModelDeploymentSpec.from_manifest(manifest)


@pytest.mark.parametrize("speculative", [None, {"method": "ngram"}], ids=["speculation off", "n-gram lookup"])
def test_no_draft_header_is_read_without_the_draft_method(speculative: dict[str, Any] | None) -> None:
    assert reconciler()._draft(spec(speculative), "models") is None


def test_the_draft_method_reads_the_drafts_header(tmp_path: Path) -> None:
    path = write_test_model(tmp_path / "draft.gguf", architecture="llama", block_count=2).path
    draft = reconciler()._draft(spec({"method": "draft", "draftModel": {"url": f"file://{path}"}}), "models")
    assert draft is not None
    assert draft.block_count == 2
    assert draft.cpu_resident_bytes > draft.resident_total_bytes > 0


def test_a_draft_that_cannot_be_read_is_refused_as_the_draft(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.gguf"
    with pytest.raises(ModelUnreadable) as refused:
        reconciler()._draft(spec({"method": "draft", "draftModel": {"url": f"file://{missing}"}}), "models")
    assert str(refused.value).startswith("draft model: ")
    assert str(missing) in str(refused.value)
    assert refused.value.reason is Reason.MODEL_NOT_FOUND
