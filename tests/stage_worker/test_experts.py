"""Generated mixtures of experts (a Qwen 3 MoE, and a Mixtral as llama.cpp writes it: architecture llama with
experts), served by pipelines of 1, 2 and 3 stages, compute what HF transformers computes from the same file, in f32:
Qwen3MoeForCausalLM through HF's own GGUF loader, MixtralForCausalLM holding the file's weights (HF reads no
Mixtral GGUF; strata_testbed.hf_reference.hf_mixtral says how it is built).

The prompts run in chunks of 8 over two slots, and 16 greedy tokens decode through the batched decode step, so the
grouped matmul over experts sees prefill chunks and decode batches alike. The stages hold exactly what the plan
counts for their layers, the experts dequantised; and a file that asks for routing no stage applies, or holds shared
experts, is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from strata.gguf import read_header
from strata.gguf.model import CacheType
from strata.gguf.reader import inspect_model
from strata.gguf.sources import open_source
from strata.gguf.testmodels import SMALL_SHAPES, write_test_model
from strata.rpc.v1 import stage_pb2
from strata.stage_worker import warm_up
from strata.stage_worker.client import Pipeline, Request
from strata.stage_worker.engine import Engine
from strata.stage_worker.errors import ModelFileError
from strata.stage_worker.experts import MixtureOfExperts
from strata.stage_worker.kv_pool import KVPool
from strata.stage_worker.loader import LoadProgress, config_from_header, load_stage
from strata_testbed.hf_reference import greedy, hf_mixtral, hf_reference
from strata_testbed.pipelines import local_pipeline
from strata_testbed.stages import load_spans
from transformers import PreTrainedModel

PROMPTS = (
    (1, 17, 200, 3, 45, 99, 12, 7, 250, 31, 64, 128, 5, 77, 190, 2, 33, 81, 140, 9),
    (4, 8, 15, 16, 23, 42, 108, 99, 250, 1, 2, 3, 200),
)
NEW_TOKENS = 16
FENCE = stage_pb2.Fence(term=1, holder="test-coordinator", lease_uid="lease-1")
QWEN3MOE = SMALL_SHAPES["qwen3moe"]


def qwen3moe_reference(path: Path) -> PreTrainedModel:
    # HF's GGUF loader reads no expert_feed_forward_length (it would build 768-wide experts); it sets norm_topk_prob.
    return hf_reference(path, config={"moe_intermediate_size": QWEN3MOE.expert_feed_forward_length})


REFERENCES: dict[str, Callable[[Path], PreTrainedModel]] = {"qwen3moe": qwen3moe_reference, "mixtral": hf_mixtral}


@dataclass(frozen=True)
class Case:
    model: str  # a key of SMALL_SHAPES
    spans: list[tuple[int, int]]


CASES = {
    "qwen3moe on one stage": Case("qwen3moe", [(0, 3)]),
    "qwen3moe on two stages": Case("qwen3moe", [(0, 2), (2, 3)]),
    "qwen3moe on three stages": Case("qwen3moe", [(0, 1), (1, 2), (2, 3)]),
    "a Mixtral-style llama on one stage": Case("mixtral", [(0, 3)]),
    "a Mixtral-style llama on two stages": Case("mixtral", [(0, 1), (1, 3)]),
    "a Mixtral-style llama on three stages": Case("mixtral", [(0, 1), (1, 2), (2, 3)]),
}


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest, over positions, of ||ours - reference|| / ||reference||."""
    return float(((ours - reference).norm(dim=-1) / reference.norm(dim=-1)).max())


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("experts")
    return {key: write_test_model(folder / f"{key}.gguf", architecture=key).path for key in REFERENCES}


@pytest.fixture(scope="module")
def expected(moe_models: dict[str, Path]) -> dict[tuple[str, int], tuple[torch.Tensor, list[int]]]:
    """HF's prompt logits and greedy continuation, per model and prompt."""
    table = {}
    for key, path in moe_models.items():
        model = REFERENCES[key](path)
        with torch.inference_mode():
            for index, prompt in enumerate(PROMPTS):
                table[key, index] = (model(torch.tensor([prompt])).logits[0], greedy(model, prompt, NEW_TOKENS))
    return table


@pytest.mark.parametrize("name", CASES)
def test_logits_and_greedy_continuations_match_hf(
    moe_models: dict[str, Path], expected: dict[tuple[str, int], tuple[torch.Tensor, list[int]]], name: str
) -> None:
    case = CASES[name]
    with local_pipeline(moe_models[case.model], case.spans) as running:
        layers = [layer for stage in running for layer in stage.service.engine.model.layers]
        assert all(isinstance(layer.ffn, MixtureOfExperts) for layer in layers), "every block is a mixture"
        pipeline = Pipeline(f"127.0.0.1:{running[0].port}", fence=FENCE)
        pipeline.claim()
        requests = [Request(prompt=p, max_tokens=NEW_TOKENS, prompt_logits=True) for p in PROMPTS]
        completions = pipeline.generate(requests, slots=2, prefill_chunk=8)
    for index, completion in enumerate(completions):
        logits, continuation = expected[case.model, index]
        assert relative_error(torch.cat(completion.prompt_logits), logits) <= 1e-4
        assert completion.tokens == continuation


def test_the_comparison_sees_the_renormalisation(moe_models: dict[str, Path]) -> None:
    """HF without renormalised top-k weights computes another model from the same qwen3moe file, so the cases above
    test the routing's normalisation, not only which experts it picks."""
    path = moe_models["qwen3moe"]
    config = {"moe_intermediate_size": QWEN3MOE.expert_feed_forward_length}
    with torch.inference_mode():
        renormalised = hf_reference(path, config=config)(torch.tensor([PROMPTS[0]])).logits[0]
        plain = hf_reference(path, config={**config, "norm_topk_prob": False})(torch.tensor([PROMPTS[0]])).logits[0]
    assert relative_error(plain, renormalised) > 1e-2


@pytest.mark.parametrize("model", list(REFERENCES))
@pytest.mark.parametrize("span", [(0, 3), (0, 1), (1, 3)], ids=["whole model", "first stage", "last stages"])
def test_a_stage_holds_every_expert_as_the_plan_counts(
    moe_models: dict[str, Path], model: str, span: tuple[int, int]
) -> None:
    """In the 2-byte compute dtype a GPU uses, a stage's bytes are the plan's resident bytes, experts and all: the
    stacked experts dequantised, the other matrices in their blocks."""
    path = moe_models[model]
    info = inspect_model(str(path))
    source = open_source(str(path))
    try:
        stage = load_stage(
            source=source,
            header=read_header(source),
            layer_start=span[0],
            layer_end=span[1],
            dtype=torch.bfloat16,
            device=torch.device("cpu"),
            progress=LoadProgress(),
        )
    finally:
        source.close()
    held = sum(t.numel() * t.element_size() for t in [*stage.parameters(), *stage.buffers()])
    planned = sum(info.layer_resident_bytes[span[0] : span[1]])
    planned += info.resident_embedding_bytes if span[0] == 0 else 0
    planned += info.resident_head_bytes if span[1] == info.block_count else 0
    shape = SMALL_SHAPES[model]
    width = shape.expert_feed_forward_length or shape.feed_forward_length
    experts = (span[1] - span[0]) * shape.expert_count * 3 * shape.embedding_length * width * 2
    assert experts <= held
    assert abs(held - planned) <= 0.02 * planned, f"held {held:,} B, planned {planned:,} B"


# What a file says about its experts that the architecture table has no place for: key -> (value, message).
ROUTING_REFUSED: dict[str, tuple[str, str, object, str]] = {
    "a qwen3moe file without an expert count": (
        "qwen3moe",
        "qwen3moe.expert_count",
        None,
        r"qwen3moe is a mixture of experts, but the file states no qwen3moe\.expert_count",
    ),
    "more experts used than there are": (
        "qwen3moe",
        "qwen3moe.expert_used_count",
        9,
        r"qwen3moe\.expert_used_count is 9; it must be between 1 and expert_count 8",
    ),
    "top-k weights stated as not renormalised": (
        "qwen3moe",
        "qwen3moe.expert_weights_norm",
        False,
        r"qwen3moe\.expert_weights_norm False; qwen3moe's experts are renormalised",
    ),
    "a sigmoid gate": (
        "mixtral",
        "llama.expert_gating_func",
        2,
        r"llama\.expert_gating_func 2, which the stage worker does not route by",
    ),
    "scaled expert weights": (
        "mixtral",
        "llama.expert_weights_scale",
        2.5,
        r"llama\.expert_weights_scale 2\.5, which the stage worker does not route by",
    ),
}


@pytest.mark.parametrize("case", ROUTING_REFUSED)
def test_routing_the_table_does_not_describe_is_refused(moe_models: dict[str, Path], case: str) -> None:
    model, key, value, message = ROUTING_REFUSED[case]
    source = open_source(str(moe_models[model]))
    try:
        header = read_header(source)
    finally:
        source.close()
    metadata = {k: v for k, v in header.metadata.items() if k != key}
    if value is not None:
        metadata[key] = value  # type: ignore[assignment]
    with pytest.raises(ModelFileError, match=message):
        config_from_header(dataclasses.replace(header, metadata=metadata))


def test_a_file_with_shared_experts_is_refused_naming_them(tmp_path: Path) -> None:
    """No architecture in the table has a shared expert (Qwen 2 MoE's), so its tensors are named, not skipped."""
    shape = dataclasses.replace(QWEN3MOE, shared_expert_feed_forward_length=64, block_count=1)
    path = write_test_model(tmp_path / "shared.gguf", architecture="qwen3moe", shape=shape).path
    source = open_source(str(path))
    try:
        with pytest.raises(
            ModelFileError, match=r"does not run: blk\.0\.ffn_down_shexp\.weight, blk\.0\.ffn_gate_inp_s"
        ):
            load_stage(
                source=source,
                header=read_header(source),
                layer_start=0,
                layer_end=1,
                dtype=torch.float32,
                device=torch.device("cpu"),
                progress=LoadProgress(),
            )
    finally:
        source.close()


def test_a_file_with_experts_in_an_architecture_without_them_is_refused(tmp_path: Path) -> None:
    shape = dataclasses.replace(SMALL_SHAPES["qwen3"], expert_count=4, expert_used_count=2)
    path = write_test_model(tmp_path / "qwen3.gguf", architecture="qwen3", shape=shape).path
    source = open_source(str(path))
    try:
        with pytest.raises(ModelFileError, match=r"states qwen3\.expert_count 4, but qwen3 models have no experts"):
            config_from_header(read_header(source))
    finally:
        source.close()


@pytest.mark.parametrize("asked", [{"cuda_graphs": True}, {"compiled": True}], ids=["CUDA graphs", "compiled blocks"])
def test_a_mixture_of_experts_decodes_eagerly(moe_models: dict[str, Path], asked: dict[str, bool]) -> None:
    """Captured on an H200, the decode step of a qwen3moe stage picked other tokens than eager decoding: until that
    is understood, asking for it is refused by name (the warm-up takes the eager path)."""
    model = load_spans(moe_models["qwen3moe"])[0]
    c = model.config
    pool = KVPool(
        n_layers=c.n_layer, context=64, parallel=1, key_width=c.kv_dim, value_width=c.kv_dim,
        type_k=CacheType.F32, type_v=CacheType.F32, dtype=torch.float32, device=torch.device("cpu"),
    )  # fmt: skip
    with pytest.raises(ValueError, match="a mixture-of-experts stage decodes eagerly"):
        Engine(model=model, pool=pool, device=torch.device("cpu"), dtype=torch.float32, **asked)
    assert not Engine(model=model, pool=pool, device=torch.device("cpu"), dtype=torch.float32).decoder.graphs
    # A stage on a GPU warms up the eager path only: the graph paths would be refused, and they have no fallback.
    assert warm_up.paths_for(torch.device("cuda"), experts=True) == (warm_up.EAGER,)
    assert warm_up.EAGER not in warm_up.paths_for(torch.device("cuda"))
