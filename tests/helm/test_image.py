"""The Dockerfile builds one non-root image for the three roles, in a CPU and a CUDA variant.

No Docker engine runs here, so the image itself is not built in tests. What can be checked without one is
checked for real: the Dockerfile's structure (stages, the user, the entrypoint, the variants), that the build
context the .dockerignore lets through holds everything the COPY lines name, and that the build stage's
install-then-compile-protos sequence yields a package whose `strata` console script runs.
"""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
from strata.operator.children import RUN_AS_USER

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
IGNORE = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n(\s*#.*\n)*", " ", text)
    result = []
    for line in joined.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            word, _, rest = stripped.partition(" ")
            result.append((word.upper(), rest.strip()))
    return result


def _stages() -> dict[str, list[tuple[str, str]]]:
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for word, rest in _instructions(DOCKERFILE):
        if word == "FROM":
            name = rest.split(" AS ")[-1].strip() if " AS " in rest else str(len(stages))
            current = stages.setdefault(name, [])
        elif current is not None:
            current.append((word, rest))
    return stages


def _args(stage: str, word: str) -> list[str]:
    return [rest for w, rest in _stages()[stage] if w == word]


def test_the_image_has_a_build_stage_and_a_runtime_stage_last() -> None:
    assert list(_stages()) == ["build", "runtime"]


def test_the_runtime_runs_as_the_user_the_pods_expect() -> None:
    assert _args("runtime", "USER") == [f"{RUN_AS_USER}:{RUN_AS_USER}"]
    (useradd,) = [r for r in _args("runtime", "RUN") if "useradd" in r]
    assert f"--uid {RUN_AS_USER}" in useradd
    assert f"--gid {RUN_AS_USER}" in useradd


def test_the_entrypoint_is_the_strata_console_script() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert _args("runtime", "ENTRYPOINT") == ['["strata"]']
    assert "strata" in scripts


def test_protos_are_compiled_in_the_build_stage_and_no_compiler_ships() -> None:
    assert any("grpc_tools.protoc" in r for r in _args("build", "RUN"))
    assert not any("pip" in r or "protoc" in r for r in _args("runtime", "RUN"))
    assert _args("runtime", "COPY") == ["--from=build /opt/strata /opt/strata"]


@pytest.mark.parametrize(
    ("variant", "torch_source"),
    [
        pytest.param(
            "cpu", "https://download.pytorch.org/whl/cpu", id="the CPU variant takes torch from the CPU index"
        ),
        pytest.param("cuda", 'index=""', id="the CUDA variant takes PyPI's torch, which bundles the CUDA runtime"),
    ],
)
def test_both_variants_are_selected_by_a_build_argument(variant: str, torch_source: str) -> None:
    (install,) = [r for r in _args("build", "RUN") if "VARIANT" in r]
    branch = re.search(rf"\b{variant}\) (.*?) ;;", install)
    assert branch is not None, f"no {variant} branch"
    assert torch_source in branch.group(1)
    assert "ARG VARIANT=cpu" in DOCKERFILE


def test_an_unknown_variant_fails_the_build() -> None:
    (install,) = [r for r in _args("build", "RUN") if "VARIANT" in r]
    assert re.search(r"\*\) echo .*exit 1", install)


def _ignored(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes."""
    ignored = False
    for pattern in IGNORE:
        negate = pattern.startswith("!")
        body = pattern.removeprefix("!").rstrip("/")
        if fnmatch.fnmatch(path, body) or path.startswith(f"{body}/") or fnmatch.fnmatch(path, f"**/{body}"):
            ignored = not negate
    return ignored


def test_every_copied_path_is_in_the_build_context() -> None:
    for stage in _stages():
        for copy in _args(stage, "COPY"):
            if copy.startswith("--from="):
                continue
            *sources, _ = copy.split()
            for source in sources:
                assert (ROOT / source).exists(), source
                assert not _ignored(source), f"{source} is excluded by .dockerignore"


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(".venv/bin/python", id="the virtual environment stays out"),
        pytest.param("tests/helm/test_image.py", id="tests stay out"),
        pytest.param("core/strata/rpc/v1/stage_pb2.py", id="locally generated protobuf code stays out"),
        pytest.param(".git/HEAD", id="git history stays out"),
        pytest.param("core/strata/gguf/__pycache__/reader.cpython-311.pyc", id="bytecode stays out"),
    ],
)
def test_the_build_context_leaves_out_local_state(path: str) -> None:
    assert _ignored(path)


def test_the_build_stage_sequence_yields_a_runnable_strata(tmp_path: Path) -> None:
    """`pip install .` then protoc into the installed package, as the build stage does, without the checkout."""
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(ROOT)]
    subprocess.run(pip, check=True, capture_output=True, timeout=300)
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "protos").rglob("*.proto"))
    out = f"--python_out={target}", f"--pyi_out={target}", f"--grpc_python_out={target}"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Iprotos", *out, *protos], cwd=ROOT, check=True)
    # -S skips site-packages' .pth files, so the editable install of this checkout cannot shadow the built one.
    env = {"PYTHONPATH": os.pathsep.join([str(target), sysconfig.get_paths()["purelib"]]), "PATH": os.environ["PATH"]}
    probe = "import strata.rpc.v1.stage_pb2, strata.cli, strata.operator.command; print(strata.cli.__file__)"
    result = subprocess.run([sys.executable, "-S", "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip().startswith(str(target))
    cli = [sys.executable, "-S", "-c", "import sys, strata.cli; sys.exit(strata.cli.main(['--help']))"]
    helped = subprocess.run(cli, env=env, capture_output=True, text=True, check=False)
    assert helped.returncode == 0, helped.stderr
    assert "operator" in helped.stdout
