"""The draft model's memory is planned: strata.draft_memory's figure from the draft's header is what the gateway
process holds once the draft is loaded (weights and KV, measured on the loaded engine), the operator's gateway pod
requests the default memory plus that figure, and a request the user set wins."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from strata.draft_memory import MIB, DraftMemory, draft_memory, memory_request
from strata.gateway.draft_model import load_draft_model
from strata.gateway.speculation import DraftSource, Speculation
from strata.gguf import read_model_header
from strata.gguf.describe import describe
from strata.gguf.model import CacheType, ModelInfo
from strata.gguf.testmodels import write_test_model
from strata.operator.children import Owner
from strata.operator.gateway_children import gateway_deployment
from strata.operator.spec import ModelDeploymentSpec
from strata.operator.status import PlanSummary, StageSummary


def info(path: Path) -> ModelInfo:
    header, size = read_model_header(str(path))
    return describe(header, file_bytes=size)


def held_bytes(module: torch.nn.Module) -> int:
    """Bytes of every tensor the module holds, each storage once (a tied head shares the embedding's)."""
    seen: set[int] = set()
    total = 0
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


LOADED = {
    "llama, q8_0 KV": ("llama", CacheType.Q8_0, 256, 2),
    "llama, f16 KV, more lanes": ("llama", CacheType.F16, 512, 4),
    "gemma3, sliding-window layers": ("gemma3", CacheType.Q8_0, 512, 2),
    "qwen2, attention biases": ("qwen2", CacheType.Q8_0, 256, 2),
}


@pytest.mark.parametrize(("architecture", "cache_type", "context", "slots"), LOADED.values(), ids=LOADED.keys())
def test_the_planned_figure_is_what_the_loaded_draft_holds(
    tmp_path: Path, architecture: str, cache_type: CacheType, context: int, slots: int
) -> None:
    path = write_test_model(tmp_path / "draft.gguf", architecture=architecture, block_count=2).path
    header = read_model_header(str(path))[0]
    planned = draft_memory(info(path), context=context, slots=slots, cache_type=cache_type)
    loaded = load_draft_model(
        DraftSource(url=str(path), cache_type=cache_type), target=header, target_url=str(path),
        speculation=Speculation(), context=context, slots=slots,
    )  # fmt: skip
    assert planned.weight_bytes == held_bytes(loaded.engine.model)
    assert planned.kv_bytes == loaded.engine.pool.nbytes
    assert planned.weight_bytes > info(path).resident_total_bytes, "a CPU holds plain values in 4 bytes, not 2"


REQUESTS = {
    "Mi plus a draft of whole Mi": ("512Mi", 100 * MIB, "612Mi"),
    "Gi plus a draft of part of a Mi, rounded up": ("1Gi", MIB + 1, "1026Mi"),
}


@pytest.mark.parametrize(("base", "draft", "request_"), REQUESTS.values(), ids=REQUESTS.keys())
def test_memory_request(base: str, draft: int, request_: str) -> None:
    assert memory_request(base, DraftMemory(weight_bytes=draft, kv_bytes=0)) == request_


@pytest.mark.parametrize("base", ["512M", "0.5Gi", "1Ti"], ids=["decimal megabytes", "a fraction", "tebibytes"])
def test_a_base_request_in_other_units_is_refused(base: str) -> None:
    with pytest.raises(ValueError, match="whole Mi or Gi"):
        memory_request(base, DraftMemory(weight_bytes=1, kv_bytes=1))


SERVING = PlanSummary(
    generation=1,
    stages=[StageSummary(index=0, node="n0", gpus=1, backend="cuda", layerStart=0, layerEnd=4)],
    contextLength=512,
    parallel=4,
    cacheTypeK="q8_0",
    cacheTypeV="q8_0",
)
DRAFT = {"method": "draft", "draftModel": {"url": "hf://org/small/small.gguf"}}


def gateway_resources(spec: dict[str, Any], draft: ModelInfo | None) -> dict[str, Any]:
    manifest = ModelDeploymentSpec.from_manifest({"model": {"url": "hf://org/big/big.gguf"}, **spec})
    deployment = gateway_deployment(
        Owner(name="m", namespace="n", uid="u"), manifest, serving=SERVING, image="strata:dev", model_name="m",
        draft=draft,
    )  # fmt: skip
    resources: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]
    return resources


def test_the_gateway_pod_requests_the_drafts_memory_over_its_own(tmp_path: Path) -> None:
    draft = info(write_test_model(tmp_path / "draft.gguf", architecture="llama", block_count=2).path)
    held = draft_memory(draft, context=SERVING.context_length, slots=SERVING.parallel, cache_type=CacheType.Q8_0)
    with_draft = gateway_resources({"speculative": DRAFT}, draft)
    assert with_draft["requests"]["memory"] == f"{512 + -(-held.total_bytes // MIB)}Mi"
    assert gateway_resources({"speculative": {"method": "ngram"}}, None)["requests"]["memory"] == "512Mi"
    assert gateway_resources({}, None)["requests"]["memory"] == "512Mi"
    mine = {"speculative": DRAFT, "gateway": {"resources": {"requests": {"memory": "3Gi"}}}}
    assert gateway_resources(mine, draft)["requests"]["memory"] == "3Gi", "a request the user set wins"
    with pytest.raises(ValueError, match="needs the draft's header"):
        gateway_resources({"speculative": DRAFT}, None)
