"""The folders map to namespaced import names, and nothing shadows the standard library's `operator`."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "cwd",
    [
        pytest.param(ROOT, id="from the repository root"),
        pytest.param(ROOT / "operator", id="from inside the operator folder"),
        pytest.param(ROOT / "tests", id="from the tests folder"),
    ],
)
def test_import_operator_is_the_standard_library(cwd: Path) -> None:
    probe = "import operator, sysconfig; print(operator.__file__); print(sysconfig.get_paths()['stdlib'])"
    result = subprocess.run([sys.executable, "-c", probe], cwd=cwd, capture_output=True, text=True, check=True)
    module_file, stdlib = result.stdout.split()
    assert Path(module_file).resolve().parent == Path(stdlib).resolve()


def test_the_operator_code_imports_under_its_own_name() -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import operator, strata.operator as o; print(o.__file__); print(operator.add(2, 3))"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    operator_file, five = result.stdout.split()
    assert Path(operator_file) == ROOT / "operator" / "strata" / "operator" / "__init__.py"
    assert five == "5"


@pytest.mark.parametrize("component", ["operator", "stage_worker", "gateway"])
def test_each_component_folder_is_a_portion_of_the_strata_namespace(component: str) -> None:
    module = importlib.import_module(f"strata.{component}")
    assert module.__file__ is not None
    assert Path(module.__file__).is_relative_to(ROOT / component)


def test_the_console_script_prints_its_version() -> None:
    result = subprocess.run(
        [Path(sys.executable).parent / "strata", "--version"], capture_output=True, text=True, check=True
    )
    assert result.stdout.startswith("strata ")


def test_generated_protobuf_code_imports_and_matches_its_schema() -> None:
    from strata.rpc.v1 import stage_pb2, stage_pb2_grpc

    service = stage_pb2.DESCRIPTOR.services_by_name["Stage"]
    assert {m.name for m in service.methods} >= {"GetLoadStatus", "Claim", "ResetSlot", "Forward"}
    assert hasattr(stage_pb2_grpc, "StageServicer")
    source = (ROOT / "protos" / "strata" / "rpc" / "v1" / "stage.proto").read_text()
    for message in stage_pb2.DESCRIPTOR.message_types_by_name:
        assert f"message {message} " in source
