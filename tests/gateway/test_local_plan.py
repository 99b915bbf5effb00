"""`strata serve` plans for this machine: the largest context that fits beside the weights, or a refusal saying why.

Models are generated GGUF headers (a Llama-3-8B-like shape, so the byte counts are a real model's), and once the same
shape in Q3_K described from its tensor dimensions (strata_testbed.model_shapes); the machine's memory is given, so
each case states exactly how much room there is.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGMLQuantizationType
from strata.cli import build_parser, main
from strata.fit import DEFAULT_HEADROOM_FRACTION, KV_BUDGET_PERCENT
from strata.gateway.local_plan import (
    DEFAULT_CONTEXT_CAP,
    LocalFitError,
    plan_local,
    process_groups,
    stage_devices,
)
from strata.gguf import inspect_model
from strata.gguf.model import CacheType, ModelInfo
from strata.gguf.testmodels import write_header_only_model, write_test_model
from strata.operator.planner import PlanOptions
from strata_testbed.model_shapes import llama3_8b

TB = 10**12
CACHE = CacheType.Q8_0
LANES = 4


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory: pytest.TempPathFactory) -> ModelInfo:
    path = tmp_path_factory.mktemp("local-plan") / "llama3-8b.gguf"
    write_header_only_model(path, shape="llama3-8b")
    return inspect_model(str(path))


def _kv(model: ModelInfo, cells: int) -> int:
    return model.kv_bytes(n_ctx=cells, type_k=CACHE, type_v=CACHE, n_seq=LANES)


def room_for(model: ModelInfo, cells: int, *, stages: int = 1) -> int:
    """Free memory in which the weights and the KV of a `cells`-token context fit (its blocks, and a partial one
    per further lane), by the headroom and 85% rules."""
    weights = plan_local(
        model=model, devices=("cpu",) * stages, parallel=LANES, cache_type=CACHE, available={"cpu": TB}
    ).weight_bytes
    usable = weights + -(-_kv(model, cells) * 100 // KV_BUDGET_PERCENT) + 1
    return int(usable / (1 - DEFAULT_HEADROOM_FRACTION)) + 2


@pytest.mark.parametrize(
    ("room_cells", "asked", "stages", "context"),
    [
        pytest.param(None, 0, 1, DEFAULT_CONTEXT_CAP, id="plenty of memory takes the default cap"),
        pytest.param(900, 0, 1, 768, id="room for a 900-token context snaps down to 768"),
        pytest.param(512, 0, 2, 512, id="room for the floor alone gets the floor, over two stages too"),
        pytest.param(2000, 1000, 1, 1000, id="an asked context that fits is kept exactly"),
        pytest.param(None, 8192, 1, 8192, id="an asked context above the cap is honoured when it fits"),
    ],
)
def test_the_context_is_the_largest_that_fits_or_the_one_asked_for(
    llama8b: ModelInfo, room_cells: int | None, asked: int, stages: int, context: int
) -> None:
    available = TB if room_cells is None else room_for(llama8b, room_cells, stages=stages)
    plan = plan_local(
        model=llama8b,
        devices=("cpu",) * stages,
        parallel=LANES,
        cache_type=CACHE,
        available={"cpu": available},
        context=asked,
    )
    assert plan.context == context
    assert plan.kv_bytes == _kv(llama8b, context)
    usable = plan.uses[0].usable_bytes
    assert usable is not None
    assert plan.weight_bytes + plan.kv_bytes * 100 // KV_BUDGET_PERCENT <= usable
    assert [end - start for start, end in plan.spans] == [32 // stages] * stages


@pytest.mark.parametrize(
    ("available", "asked", "stages", "error", "message"),
    [
        pytest.param(
            4 * 10**9, 0, 1, LocalFitError, r"requires .* GB on cpu at context 512, .* short by",
            id="weights beyond the memory are refused with the shortfall",
        ),
        pytest.param(
            "room-900", 4096, 1, LocalFitError, "the largest context that fits is 768",
            id="an asked context that does not fit names the largest that does",
        ),
        pytest.param(
            TB, 16384, 1, LocalFitError, "exceeds the model's native context 8192",
            id="an asked context beyond the native one is refused",
        ),
        pytest.param(
            TB, 0, 33, ValueError, "cannot split 32 layers into 33 stages", id="more stages than layers are refused"
        ),
    ],
)  # fmt: skip
def test_what_does_not_fit_is_refused_saying_why(
    llama8b: ModelInfo, available: int | str, asked: int, stages: int, error: type[Exception], message: str
) -> None:
    free = room_for(llama8b, 900) if available == "room-900" else available
    assert isinstance(free, int)
    with pytest.raises(error, match=message):
        plan_local(
            model=llama8b,
            devices=("cpu",) * stages,
            parallel=LANES,
            cache_type=CACHE,
            available={"cpu": free},
            context=asked,
        )


def test_unknown_memory_checks_nothing_and_keeps_the_default_context(llama8b: ModelInfo) -> None:
    plan = plan_local(model=llama8b, devices=("cpu",) * 2, parallel=LANES, cache_type=CACHE, available={"cpu": None})
    assert (plan.context, plan.uses[0].usable_bytes) == (DEFAULT_CONTEXT_CAP, None)


@pytest.mark.parametrize(
    ("architecture", "stages", "extra"),
    [
        pytest.param("qwen2", 1, "", id="one stage holds each tensor once"),
        pytest.param("qwen2", 2, "", id="two stages of an untied model hold each tensor once"),
        pytest.param("qwen3", 1, "", id="one stage of a tied model holds token_embd once"),
        pytest.param("qwen3", 2, "token_embd", id="two stages of a tied model both hold token_embd"),
    ],
)
def test_weights_count_what_each_stage_loads(tmp_path: Path, architecture: str, stages: int, extra: str) -> None:
    written = write_test_model(tmp_path / f"{architecture}.gguf", architecture=architecture, block_count=2)
    model = inspect_model(str(written.path))
    plan = plan_local(model=model, devices=("cpu",) * stages, parallel=LANES, cache_type=CACHE, available={"cpu": TB})
    resident = sum(tensor.resident_bytes for tensor in written.tensors)
    assert plan.weight_bytes == resident + (written.tensor_resident_bytes(f"{extra}.weight") if extra else 0)


@pytest.mark.parametrize(
    ("weights", "loaded", "refusal"),
    [
        pytest.param(
            "Q4_K/Q6_K",
            5_257_691_136,
            None,
            id="Q4_K and Q6_K stay in their blocks: 5.17 GB in the file is 5.26 GB loaded, and 12 GB holds it",
        ),
        pytest.param(
            "Q3_K",
            16_060_522_496,
            r"^requires 16\.1 GB on cpu at context 512, it has 10\.8 GB usable, short by 5\.3 GB$",
            id="Q3_K is dequantised to 2 bytes per value: 3.45 GB in the file is 16.06 GB loaded, and 12 GB is refused",
        ),
    ],
)
def test_a_model_is_sized_by_what_its_stages_load_not_by_its_file(
    llama8b: ModelInfo, weights: str, loaded: int, refusal: str | None
) -> None:
    # The same Llama-3-8B shape in the K-quants downloads use (a generated header) and all in Q3_K. 12 GB free is
    # 10.8 GB usable; 512 cells of q8_0 KV take 35,651,584 B, 41,943,040 B once the 85% rule is applied.
    model = llama8b if weights == "Q4_K/Q6_K" else llama3_8b(weight_type=GGMLQuantizationType.Q3_K)
    assert model.total_bytes < 12 * 10**9
    assert model.resident_total_bytes == loaded
    if refusal is not None:
        with pytest.raises(LocalFitError, match=refusal):
            plan_local(
                model=model, devices=("cpu",) * 1, parallel=LANES, cache_type=CACHE, available={"cpu": 12 * 10**9}
            )
        return
    plan = plan_local(
        model=model, devices=("cpu",) * 1, parallel=LANES, cache_type=CACHE, available={"cpu": 12 * 10**9}
    )
    assert (plan.weight_bytes, plan.context) == (loaded, DEFAULT_CONTEXT_CAP)


def test_serve_refuses_a_context_beyond_the_models_before_starting_anything(tmp_path: Path) -> None:
    written = write_test_model(tmp_path / "qwen2.gguf", architecture="qwen2")
    with pytest.raises(SystemExit) as exited:
        main(["serve", str(written.path), "--context", "1000000", "--port", "0"])
    assert str(exited.value.code).startswith("strata serve: context 1000000 exceeds the model's native context")


def test_serve_plans_a_q8_0_kv_cache_by_default_as_the_operator_does() -> None:
    operator_default = PlanOptions()
    assert operator_default.cache_type_k == operator_default.cache_type_v == CacheType.Q8_0
    assert build_parser().parse_args(["serve"]).cache_type == CacheType.Q8_0.value


@pytest.mark.parametrize(
    ("device", "devices", "stages", "gpus", "placed"),
    [
        pytest.param("cpu", "", 3, 0, ("cpu",) * 3, id="every stage on the CPU by default"),
        pytest.param("cuda", "", 3, 2, ("cuda:0", "cuda:1", "cuda:0"), id="cuda deals stage i to GPU i mod the count"),
        pytest.param("cuda", "", 2, 1, ("cuda:0", "cuda:0"), id="one GPU takes every stage"),
        pytest.param("cuda:1", "", 2, 2, ("cuda:1", "cuda:1"), id="a named GPU takes every stage"),
        pytest.param("cpu", "cuda:0, cpu", 2, 1, ("cuda:0", "cpu"), id="devices place a CPU stage beside a GPU one"),
    ],
)
def test_stages_are_placed_on_the_devices_asked_for(
    device: str, devices: str, stages: int, gpus: int, placed: tuple[str, ...]
) -> None:
    assert stage_devices(device=device, devices=devices, stages=stages, gpu_count=gpus) == placed


@pytest.mark.parametrize(
    ("devices", "one_each", "groups"),
    [
        pytest.param(("cpu",), False, ((0,),), id="one stage is one process"),
        pytest.param(("cpu",) * 3, False, ((0, 1, 2),), id="stages on one device share one process"),
        pytest.param(("cuda:0", "cuda:1", "cuda:0"), False, ((0,), (1,), (2,)), id="dealt over GPUs: one each"),
        pytest.param(
            ("cuda:0", "cuda:0", "cpu", "cpu"), False, ((0, 1), (2, 3)), id="each run of one device shares one"
        ),
        pytest.param(("cpu",) * 2, True, ((0,), (1,)), id="a process per stage when asked"),
    ],
)
def test_consecutive_stages_on_one_device_share_a_process(
    devices: tuple[str, ...], one_each: bool, groups: tuple[tuple[int, ...], ...]
) -> None:
    assert process_groups(devices, process_per_stage=one_each) == groups


@pytest.mark.parametrize(
    ("device", "devices", "stages", "gpus", "message"),
    [
        pytest.param("cuda", "", 2, 0, "no CUDA GPU is visible", id="cuda without a GPU"),
        pytest.param("cuda:2", "", 1, 2, r"'cuda:2': this machine has 2 CUDA GPU\(s\)", id="a GPU that is not there"),
        pytest.param("cpu", "cuda:0,cpu", 3, 1, "names 2 devices for 3 stages", id="devices not one per stage"),
        pytest.param("tpu", "", 1, 0, "'tpu' is not cpu, cuda or cuda:N", id="a device kind stages do not run on"),
    ],
)
def test_a_placement_that_cannot_be_made_is_refused(
    device: str, devices: str, stages: int, gpus: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        stage_devices(device=device, devices=devices, stages=stages, gpu_count=gpus)


def test_each_device_fits_its_own_stages_and_the_smallest_room_sets_the_context(llama8b: ModelInfo) -> None:
    """Two stages on two devices: each holds half the layers and its own end of the model; the device with room for
    fewer cells sets the context for both."""
    roomy = plan_local(
        model=llama8b, devices=("cuda:0", "cpu"), parallel=LANES, cache_type=CACHE, available={"cuda:0": TB, "cpu": TB}
    )
    gpu, cpu = roomy.uses
    assert (gpu.device, gpu.stages, cpu.device, cpu.stages) == ("cuda:0", (0,), "cpu", (1,))
    assert gpu.weight_bytes == sum(llama8b.layer_resident_bytes[:16]) + llama8b.resident_embedding_bytes
    assert cpu.weight_bytes == sum(llama8b.layer_resident_bytes[16:]) + llama8b.resident_head_bytes
    assert gpu.kv_bytes == cpu.kv_bytes == _kv(llama8b, roomy.context) // 2
    # Room on the GPU for a 900-token context of its 16 layers: the context snaps to 768 although the CPU has a TB.
    half_kv = -(-_kv(llama8b, 900) // 2 * 100 // KV_BUDGET_PERCENT) + 1
    free = int((gpu.weight_bytes + half_kv) / (1 - DEFAULT_HEADROOM_FRACTION)) + 2
    tight = plan_local(
        model=llama8b,
        devices=("cuda:0", "cpu"),
        parallel=LANES,
        cache_type=CACHE,
        available={"cuda:0": free, "cpu": TB},
    )
    assert tight.context == 768
    with pytest.raises(LocalFitError, match=r"needs .* GB of KV on cuda:0 .* the largest context that fits is 768"):
        plan_local(
            model=llama8b, devices=("cuda:0", "cpu"), parallel=LANES, cache_type=CACHE,
            available={"cuda:0": free, "cpu": TB}, context=4096,
        )  # fmt: skip


def test_stages_sharing_a_device_are_fitted_together(llama8b: ModelInfo) -> None:
    alone = plan_local(model=llama8b, devices=("cuda:0",), parallel=LANES, cache_type=CACHE, available={"cuda:0": TB})
    shared = plan_local(
        model=llama8b, devices=("cuda:0", "cuda:0"), parallel=LANES, cache_type=CACHE, available={"cuda:0": TB}
    )
    (use,) = shared.uses
    assert (use.stages, use.weight_bytes, use.kv_bytes) == ((0, 1), alone.weight_bytes, alone.kv_bytes)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        pytest.param(["--device", "cuda"], "--device cuda: no CUDA GPU is visible", id="cuda on a machine without"),
        pytest.param(["--device", "cuda:0", "--devices", "cpu"], "give --device or --devices", id="both flags"),
        pytest.param(["--stages", "2", "--devices", "cpu"], "names 1 devices for 2 stages", id="too few devices"),
        pytest.param(
            ["--resident-window", "1024"],
            "--resident-window a resident window of 1024 tokens leaves no block",
            id="a resident window with nothing to choose",
        ),
    ],
)
def test_serve_refuses_a_placement_before_starting_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: list[str], message: str
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    written = write_test_model(tmp_path / "qwen2.gguf", architecture="qwen2")
    with pytest.raises(SystemExit) as exited:
        main(["serve", str(written.path), "--port", "0", *flags])
    assert str(exited.value.code).startswith("strata serve: ")
    assert message in str(exited.value.code)
