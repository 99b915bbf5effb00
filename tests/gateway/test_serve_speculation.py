"""`strata serve`'s speculative-decoding options: combinations that cannot serve are refused before any stage starts,
with the files named, and a draft of the target's vocabulary passes."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
from strata.cli import main
from strata.draft_memory import draft_memory
from strata.gateway import serve_speculation
from strata.gguf import read_model_header
from strata.gguf.describe import describe
from strata.gguf.model import CacheType
from strata.gguf.testmodels import SMALL_SHAPES, write_test_model


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("serve-speculation")
    other_vocabulary = dataclasses.replace(SMALL_SHAPES["llama"], vocab_size=1200)
    return {
        "target": write_test_model(folder / "target.gguf", architecture="llama").path,
        "same vocabulary": write_test_model(folder / "small.gguf", architecture="llama", block_count=1, seed=4).path,
        "other vocabulary": write_test_model(folder / "vocab.gguf", architecture="llama", shape=other_vocabulary).path,
    }


def options(argv: list[str], files: dict[str, Path]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_speculation.add_arguments(parser)
    return parser.parse_args([str(files.get(arg, arg)) for arg in argv])


# The options (a file's key stands for its path) and what the refusal says; None: accepted.
CASES: dict[str, tuple[list[str], tuple[str, ...] | None]] = {
    "off": ([], None),
    "n-gram lookup": (["--speculative", "ngram"], None),
    "a draft of the target's vocabulary": (["--speculative", "draft", "--draft", "same vocabulary"], None),
    "the draft method without a draft": (["--speculative", "draft"], ("method draft needs the draft model's file",)),
    "a draft with n-gram lookup": (
        ["--speculative", "ngram", "--draft", "same vocabulary"],
        ("a draft model apply to speculative decoding method draft only",),
    ),
    "a probability floor without a draft": (["--p-min", "0.5"], ("draft probability floor (p min)",)),
    "a probability floor above 1": (
        ["--speculative", "draft", "--draft", "same vocabulary", "--p-min", "1.5"],
        ("within [0, 1]",),
    ),
    "draft bounds without speculation": (["--max-draft", "8"], ("speculative decoding, which is off",)),
    "a position cost without speculation": (["--position-cost", "0.5"], ("a position cost apply",)),
    "a position cost above a step's": (["--speculative", "ngram", "--position-cost", "2"], ("position cost within",)),
    "a position cost with n-gram lookup": (["--speculative", "ngram", "--position-cost", "0.5"], None),
    "a draft of another vocabulary": (
        ["--speculative", "draft", "--draft", "other vocabulary"],
        ("vocab.gguf has a vocabulary of 1200 tokens", "target.gguf"),
    ),
    "a draft file that is missing": (["--speculative", "draft", "--draft", "/nowhere/d.gguf"], ("/nowhere/d.gguf",)),
}


@pytest.mark.parametrize(("argv", "words"), CASES.values(), ids=CASES.keys())
def test_serve_refuses_speculative_options_that_cannot_serve(
    files: dict[str, Path], argv: list[str], words: tuple[str, ...] | None
) -> None:
    target = files["target"]
    refusal = serve_speculation.refusal(
        options(argv, files), target=read_model_header(str(target))[0], target_url=str(target)
    )
    if words is None:
        assert refusal is None
        return
    assert refusal is not None
    for word in words:
        assert word in refusal


def test_serve_exits_with_the_refusal_before_any_stage_starts(files: dict[str, Path]) -> None:
    target, draft = files["target"], files["other vocabulary"]
    with pytest.raises(SystemExit) as exited:
        main(["serve", str(target), "--speculative", "draft", "--draft", str(draft)])
    message = str(exited.value.code)
    assert message.startswith("strata serve: ")
    assert str(draft) in message
    assert str(target) in message


REPORTS = {
    "off": ([], None),
    "n-gram lookup": (["--speculative", "ngram"], None),
    "a draft on the CPU": (["--speculative", "draft", "--draft", "same vocabulary"], True),
    "a draft on a GPU": (["--speculative", "draft", "--draft", "same vocabulary", "--draft-device", "cuda"], False),
}


@pytest.mark.parametrize(("argv", "on_cpu"), REPORTS.values(), ids=REPORTS.keys())
def test_serve_reports_what_the_draft_holds_in_the_gateway(
    files: dict[str, Path], argv: list[str], on_cpu: bool | None
) -> None:
    report = serve_speculation.draft_report(options(argv, files), context=512, slots=4)
    if on_cpu is None:
        assert report is None
        return
    header, size = read_model_header(str(files["same vocabulary"]))
    draft = describe(header, file_bytes=size)
    held = draft_memory(draft, context=512, slots=4, cache_type=CacheType.Q8_0, on_cpu=on_cpu)
    device = "cpu" if on_cpu else "cuda"
    assert (
        report == f"plan: draft model {files['same vocabulary']} on {device}, in the gateway process: {held.describe()}"
    )
    assert held.weight_bytes == (draft.cpu_resident_bytes if on_cpu else draft.resident_total_bytes)
    assert held.kv_bytes > 0
    assert held.weight_bytes > 0
