"""Which models Strata's stages can run: one answer for `strata inspect`, `strata serve` and the operator's planning.

A model of another architecture reads and plans like any other (its header says what it would take), but every stage
would fail to load it. So the places that decide to run a model ask here first and refuse with this reason, instead
of starting stages that load nothing: `strata serve` exits before starting any, the operator sets `Planned=False`,
and `strata inspect` says so. The stage worker's loader (strata.stage_worker.loader) raises the same reason, and a
test keeps its table of architectures equal to this set. The set is the architecture table's
(strata.gguf.architectures): an architecture runs exactly when the table describes it. A file of such an
architecture may still ask for something the stages do not apply (a RoPE scaling, strata.gguf.rope_scaling): the
header's description carries that as `unsupported`, and the same checks refuse it; so does a tokenizer the
gateway cannot build (strata.gateway.tokenizer reads TOKENIZER_MODELS from here) and a tensor of a type no stage
can load (LOADABLE_TYPES: what strata.stage_worker.loader reads as stored or dequantises through gguf-py; a test
keeps the set equal to what gguf-py dequantises).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gguf import GGMLQuantizationType
from strata.gguf.architectures import ARCHITECTURES

EXECUTABLE_ARCHITECTURES = frozenset(ARCHITECTURES)
TOKENIZER_MODELS = frozenset({"gpt2", "llama"})  # tokenizer.ggml.model: byte-level BPE and SentencePiece

_T = GGMLQuantizationType
LOADABLE_TYPES = frozenset(
    {_T.F32, _T.F16, _T.BF16, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0, _T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K,
     _T.Q6_K, _T.IQ1_S, _T.IQ1_M, _T.IQ2_XXS, _T.IQ2_XS, _T.IQ2_S, _T.IQ3_XXS, _T.IQ3_S, _T.IQ4_NL, _T.IQ4_XS,
     _T.TQ1_0, _T.TQ2_0, _T.MXFP4, _T.NVFP4}
)  # fmt: skip


class NotExecutableError(ValueError):
    """The model is of an architecture Strata's stage worker does not run; the message says which ones it runs."""


def not_executable_reason(architecture: str, *, unsupported: str | None = None) -> str | None:
    """Why Strata's stages cannot run a model of `architecture` whose file asks for `unsupported` (what
    ModelInfo.unsupported says), or None when they can."""
    if architecture not in EXECUTABLE_ARCHITECTURES:
        runs = ", ".join(sorted(EXECUTABLE_ARCHITECTURES))
        return f"architecture {architecture!r} is not one the stage worker runs ({runs})"
    return unsupported


def header_refusal(metadata: Mapping[str, object], tensors: Iterable[tuple[str, GGMLQuantizationType]]) -> str | None:
    """What in a file of a runnable architecture the stages or the gateway cannot take: a tokenizer model the
    gateway does not build, or a tensor of a type no stage loads (the first one, by name)."""
    model = metadata.get("tokenizer.ggml.model")
    if model not in TOKENIZER_MODELS:
        known = ", ".join(sorted(TOKENIZER_MODELS))
        return f"tokenizer.ggml.model {model!r} is not a tokenizer the gateway builds ({known})"
    for name, ggml_type in tensors:
        if ggml_type not in LOADABLE_TYPES:
            return f"tensor {name} is of type {ggml_type.name}, which no stage loads"
    return None


def check_executable(architecture: str, *, unsupported: str | None = None) -> None:
    """Raise NotExecutableError unless Strata's stages run this model."""
    reason = not_executable_reason(architecture, unsupported=unsupported)
    if reason is not None:
        raise NotExecutableError(reason)
