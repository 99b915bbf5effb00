"""`strata inspect --kv-host-memory`: how many tokens of KV a host budget holds, per cache type, beside the KV bytes
per token; a budget that is no quantity is refused naming the option."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from strata.cli import main
from strata.gguf import CacheType, inspect_model
from strata.gguf.testmodels import write_test_model

GIB = 1 << 30


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_test_model(tmp_path_factory.mktemp("inspect") / "q.gguf", architecture="qwen2", seed=1).path


def test_the_json_says_what_the_host_budget_holds(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(model), "--json", "--kv-host-memory", "1Gi"]) == 0
    report = json.loads(capsys.readouterr().out)
    info = inspect_model(str(model))
    per_token = info.kv_bytes_per_token(type_k=CacheType.Q8_0, type_v=CacheType.Q8_0)
    assert report["host_kv"]["bytes"] == GIB
    assert report["host_kv"]["tokens"]["q8_0"] == GIB // per_token > report["host_kv"]["tokens"]["f16"]


@pytest.mark.parametrize(
    ("args", "shown"),
    [
        pytest.param(["--kv-host-memory", "1Gi"], True, id="with a host budget the table has a host KV row"),
        pytest.param([], False, id="without one it has none"),
    ],
)
def test_the_table_shows_host_kv_only_when_asked(
    model: Path, capsys: pytest.CaptureFixture[str], args: list[str], shown: bool
) -> None:
    assert main(["inspect", str(model), *args]) == 0
    assert ("host KV" in capsys.readouterr().out) is shown


def test_a_budget_that_is_no_quantity_is_refused_naming_the_option(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(model), "--kv-host-memory", "lots"]) == 1
    assert "--kv-host-memory 'lots' is not a Kubernetes quantity" in capsys.readouterr().err
