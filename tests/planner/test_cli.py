"""`strata plan`: the same plan as a table or JSON, from generated GGUF headers and a kubectl-style node file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from strata.cli import main
from strata.gguf.testmodels import write_header_only_model
from strata_testbed.cluster_objects import gpu_node, gpu_pod
from strata_testbed.gpu_pool import POOL_FILE

# The JSON fields `strata plan --json` documents; scripts read them, so each must stay present.
PLAN_KEYS = {
    "feasible",
    "stages",
    "context_length",
    "parallel",
    "cache_type_k",
    "cache_type_v",
    "kv_bytes_per_token",
    "excluded",
    "shortfall",
}
STAGE_KEYS = {
    "index",
    "node",
    "gpus",
    "backend",
    "layer_start",
    "layer_end",
    "weight_bytes",
    "kv_bytes",
    "usable_bytes",
}
EXCLUDED_KEYS = {"node", "reason"}
SHORTFALL_KEYS = {"required_bytes", "available_bytes", "short_by_bytes", "message"}


@pytest.fixture(scope="module")
def llama70b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "llama3-70b.gguf"
    write_header_only_model(path, shape="llama3-70b")
    return path


@pytest.fixture(scope="module")
def qwen_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "qwen3-30b-a3b.gguf"
    write_header_only_model(path, shape="qwen3-30b-a3b")
    return path


def _write(tmp_path: Path, document: dict[str, Any]) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def test_the_json_plan_on_the_testbed_pool_names_stages_and_excluded_nodes(
    llama70b: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", str(llama70b), "--nodes", str(POOL_FILE), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["feasible"] is True
    assert plan["shortfall"] is None
    assert plan["context_length"] == 131072
    assert (plan["parallel"], plan["cache_type_k"], plan["cache_type_v"]) == (4, "q8_0", "q8_0")
    assert plan["stages"][0]["layer_start"] == 0
    assert plan["stages"][-1]["layer_end"] == 80
    assert set(plan) >= PLAN_KEYS
    assert plan["stages"]
    assert all(set(stage) >= STAGE_KEYS for stage in plan["stages"])
    assert all(set(excluded) >= EXCLUDED_KEYS for excluded in plan["excluded"])
    assert {e["node"] for e in plan["excluded"]} == {"gpu-cordoned-0", "gpu-notready-0", "gpu-tainted-0"}


def test_the_table_shows_stages_and_reasons(llama70b: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(llama70b), "--nodes", str(POOL_FILE), "--max-stages", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("context 131072 tokens, 4 parallel slots, KV q8_0/q8_0")
    assert "0-79 +embd +head" in out
    assert "taint dedicated=training:NoSchedule is not tolerated" in out


def test_overrides_reach_the_plan(qwen_moe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Two 48 GB GPUs: the Q4_K/Q6_K file is 19.8 GB; loaded, it takes 59.0 GB, its experts dequantised.
    nodes = _write(tmp_path, {"apiVersion": "v1", "kind": "NodeList", "items": [gpu_node("l40s", gpus=2, gib=48)]})
    args = ["--context", "8192", "--parallel", "2", "--cache-type-k", "f16", "--cache-type-v", "q4_0", "--json"]
    assert main(["plan", str(qwen_moe), "--nodes", str(nodes), *args]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["context_length"], plan["parallel"], plan["cache_type_k"], plan["cache_type_v"]) == (
        8192,
        2,
        "f16",
        "q4_0",
    )


def test_a_pool_too_small_exits_2_with_the_shortfall(
    llama70b: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    items = [gpu_node("a10g", gpus=2, gib=24), gpu_pod("busy", node="a10g", gpus=1)]
    nodes = _write(tmp_path, {"apiVersion": "v1", "kind": "List", "items": items})
    assert main(["plan", str(llama70b), "--nodes", str(nodes), "--json"]) == 2
    plan = json.loads(capsys.readouterr().out)
    assert set(plan) >= PLAN_KEYS
    assert set(plan["shortfall"]) >= SHORTFALL_KEYS
    assert plan["feasible"] is False
    assert plan["stages"] == []
    assert "across 1 GPU, short by" in plan["shortfall"]["message"]
    assert (
        plan["shortfall"]["short_by_bytes"]
        == plan["shortfall"]["required_bytes"] - plan["shortfall"]["available_bytes"]
    )


def test_an_override_that_cannot_fit_exits_2_saying_what_would(
    llama70b: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 45.8 GB of Q4_K/Q6_K blocks leave three 24 GiB GPUs room for 100864 of the native 131072 tokens: the first
    # stage (27 layers and token_embd) keeps 85% of 7.00 GB for KV, 5.95 GB, at 58,752 B a cell: 101,286 cells,
    # less a 64-cell block for each of the three slots beyond the first: 101,094.
    nodes = _write(tmp_path, {"apiVersion": "v1", "kind": "List", "items": [gpu_node("a10g", gpus=3, gib=24)]})
    assert main(["plan", str(llama70b), "--nodes", str(nodes), "--context", "131072"]) == 2
    assert capsys.readouterr().err == (
        "strata plan: does not fit: context 131072 needs 7.7 GB of KV on stage 0 (a10g) which has 6.0 GB free; "
        "the largest context that fits is 100864\n"
    )


@pytest.mark.parametrize(
    ("nodes_text", "model_name", "message"),
    [
        pytest.param("items: [", None, "not YAML", id="a nodes file that is not YAML is bad input"),
        pytest.param("kind: Node\n", None, "expected a List or NodeList", id="a single object is bad input"),
        pytest.param("kind: List\nitems: []\n", None, "no Node objects", id="a list without nodes is bad input"),
        pytest.param(None, "missing.gguf", "missing.gguf", id="a missing model file is bad input"),
    ],
)
def test_bad_input_exits_1_naming_what_is_wrong(
    llama70b: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    nodes_text: str | None,
    model_name: str | None,
    message: str,
) -> None:
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(nodes_text or POOL_FILE.read_text())
    model = tmp_path / model_name if model_name else llama70b
    assert main(["plan", str(model), "--nodes", str(nodes)]) == 1
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        pytest.param(
            ["--parallel", "abc"],
            "argument --parallel: invalid int value: 'abc'",
            id="a lane count that is not a number",
        ),
        pytest.param(
            ["--context", "4k"], "argument --context: invalid int value: '4k'", id="a context that is not a number"
        ),
        pytest.param(
            ["--cache-type-k", "bogus"], "argument --cache-type-k: invalid choice: 'bogus'", id="an unknown cache type"
        ),
    ],
)
def test_a_command_line_that_does_not_parse_exits_1_not_the_shortfall_status(
    llama70b: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["plan", str(llama70b), "--nodes", str(POOL_FILE), *flags])
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("usage: strata plan")
    assert f"strata plan: error: {message}" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(
            ["plan", "model.gguf"], "the following arguments are required: --nodes", id="plan without --nodes"
        ),
        pytest.param(
            ["plan", "--nodes", "nodes.yaml"], "the following arguments are required: MODEL", id="plan without a model"
        ),
        pytest.param(["inspect"], "the following arguments are required: MODEL", id="inspect without a model"),
        pytest.param(
            ["inspect", "model.gguf", "--yaml"], "unrecognized arguments: --yaml", id="inspect with an unknown flag"
        ),
        pytest.param(["plans"], "invalid choice: 'plans'", id="a misspelt subcommand"),
    ],
)
def test_a_missing_argument_or_unknown_command_exits_1(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 1
    assert message in capsys.readouterr().err
