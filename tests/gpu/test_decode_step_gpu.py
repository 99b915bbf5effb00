"""What a GPU decode step does differently from the CPU's, checked against the same stage without it: each block's
norms (and the residual adds before them) formed in the next quantised matrix's load of x (model.normed_projection),
the next step launched before this one's picks are read (strata.stage_worker.decode_ahead), steps that verify
drafts replayed from graphs of a few rows a slot (strata.stage_worker.wide_step), and a resident window's table and
queries written inside captured steps (strata.stage_worker.kv_resident).

Needs a CUDA device (run on a GPU lease); skipped elsewhere, where the CPU path never takes the fused form. The kernel
itself is checked against the reference on the CPU too (tests/stage_worker/test_quant_matmul.py's normed cases).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from strata.gguf.model import CacheType
from strata.gguf.testmodels import write_test_model
from strata.gguf.testmodels.shapes import K_QUANT_SHAPE
from strata.stage_worker import model
from strata.stage_worker.engine import Chunk, Engine
from strata.stage_worker.kernels import paged_attention
from strata.stage_worker.kernels.quant_matmul import FUSED_TYPES
from strata.stage_worker.kv_pool import KVPool
from strata.stage_worker.kv_resident import ResidentShape
from strata.stage_worker.stage_load import keep_resident
from strata.stage_worker.weights import linear
from strata.stage_worker.weights.linear import PackedLinear
from strata_testbed.stages import load_spans

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU lease)")

Q = GGMLQuantizationType
LAYERS = 3
PROMPT = (1, 17, 200, 3, 45, 99, 12, 7, 250, 31, 64, 128)
STEPS = 16


def _engine(path: Path, dtype: torch.dtype, *, ahead: bool | None = None, context: int = 128) -> Engine:
    device = torch.device("cuda")
    (model,) = load_spans(path, dtype=dtype, device=device)
    c = model.config
    pool = KVPool(
        n_layers=c.n_layer, context=context, parallel=4, key_width=c.kv_dim, value_width=c.kv_dim,
        type_k=CacheType.F32, type_v=CacheType.F32, dtype=dtype, device=device,
    )  # fmt: skip
    return Engine(model=model, pool=pool, device=device, dtype=dtype, decode_ahead=ahead)


def _decode(engine: Engine, streams: int) -> tuple[list[list[int]], torch.Tensor]:
    """Prefill PROMPT into `streams` slots, then STEPS greedy steps of all of them at once: the tokens of each, and
    the last step's log-probabilities."""
    chunks = [Chunk(slot=s, start_position=0, length=len(PROMPT), token_ids=PROMPT, sample=True)
              for s in range(streams)]  # fmt: skip
    tokens: list[list[int]] = [[] for _ in range(streams)]
    logprobs: list[float] = []
    for step in range(STEPS + 1):
        result = engine.step(chunks, None)
        for s in range(streams):
            tokens[s].append(result.tokens[s].token_id)
        logprobs = [result.tokens[s].logprob for s in range(streams)]
        chunks = [
            Chunk(slot=s, start_position=len(PROMPT) + step, length=1, token_ids=(tokens[s][-1],), sample=True)
            for s in range(streams)
        ]
    return tokens, torch.tensor(logprobs)


@pytest.mark.parametrize("streams", [1])  # PackedLinear.takes_norm: one row only, for now
@pytest.mark.parametrize("weight_type", [Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_norms_in_the_products_decode_as_the_separate_norms(
    weight_type: GGMLQuantizationType, streams: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shape = K_QUANT_SHAPE if weight_type in (Q.Q4_K, Q.Q6_K) else None  # K-quant rows are 256 values a block
    path = write_test_model(
        tmp_path / "model.gguf", architecture="llama", block_count=LAYERS, shape=shape, weight_type=weight_type
    ).path
    monkeypatch.setattr(linear, "NORMED_TYPES", FUSED_TYPES)  # the kernel's normed load, for every type it reads
    fused_engine = _engine(path, torch.float32)
    calls = []
    normed = PackedLinear.normed

    def counted(self: PackedLinear, *args: object, **kwargs: object) -> object:
        calls.append(1)
        return normed(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(PackedLinear, "normed", counted)
    fused, fused_logprobs = _decode(fused_engine, streams)
    assert calls, "the GPU decode step never formed a norm in a product"
    monkeypatch.setattr(PackedLinear, "takes_norm", lambda self, x: False)
    torch._dynamo.reset()  # the compiled blocks of the first engine must not serve the second
    separate, separate_logprobs = _decode(_engine(path, torch.float32), streams)
    assert fused == separate
    assert torch.allclose(fused_logprobs, separate_logprobs, atol=1e-4), (fused_logprobs, separate_logprobs)


@pytest.mark.parametrize("weight_type", [Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_the_activation_in_the_products_decodes_as_apart(
    weight_type: GGMLQuantizationType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """act(gate) * up formed as the gate/up product stores (PackedLinear.activates: one row) decodes the tokens and
    log-probabilities of the activation computed apart."""
    shape = K_QUANT_SHAPE if weight_type in (Q.Q4_K, Q.Q6_K) else None
    path = write_test_model(
        tmp_path / "model.gguf", architecture="llama", block_count=LAYERS, shape=shape, weight_type=weight_type
    ).path
    calls = []
    activation, normed_activation = PackedLinear.activation, PackedLinear.normed_activation

    def counted(original: Callable[..., object]) -> Callable[..., object]:
        def call(self: PackedLinear, *args: object, **kwargs: object) -> object:
            calls.append(1)
            return original(self, *args, **kwargs)

        return call

    monkeypatch.setattr(PackedLinear, "activation", counted(activation))
    monkeypatch.setattr(PackedLinear, "normed_activation", counted(normed_activation))
    together, together_logprobs = _decode(_engine(path, torch.float32), 1)
    assert calls, "the GPU decode step never formed the activation in a product"
    monkeypatch.setattr(PackedLinear, "activates", lambda self, x: False)
    torch._dynamo.reset()
    apart, apart_logprobs = _decode(_engine(path, torch.float32), 1)
    assert together == apart
    assert torch.allclose(together_logprobs, apart_logprobs, atol=1e-4), (together_logprobs, apart_logprobs)


@pytest.mark.parametrize("streams", [1, 3])
def test_decoding_ahead_decodes_as_without(streams: int, tmp_path: Path) -> None:
    """With CUDA graphs, pinned picks and tokens fed on the device: the same tokens and log-probabilities."""
    path = write_test_model(tmp_path / "model.gguf", architecture="llama", block_count=LAYERS, weight_type=Q.Q8_0).path
    ahead = _engine(path, torch.float32)
    assert ahead.decodes_ahead
    tokens, logprobs = _decode(ahead, streams)
    expected_tokens, expected_logprobs = _decode(_engine(path, torch.float32, ahead=False), streams)
    assert tokens == expected_tokens
    assert torch.equal(logprobs, expected_logprobs)


@pytest.mark.parametrize(
    ("architecture", "streams"), [("llama", 1), ("llama", 3), ("gemma3", 3)], ids=["llama-1", "llama-3", "gemma3-3"]
)
def test_drafts_verified_in_captured_steps_give_the_plain_tokens(
    architecture: str, streams: int, tmp_path: Path
) -> None:
    """Stream s drafts s + 1 tokens a step, the true continuation with its last token wrong: widths differ (fillers),
    some drafts are accepted and one a step is rejected; the text is the one of one position a step. The steps of
    drafts run compiled blocks (model.run_wide_block), the plain ones their own."""
    path = write_test_model(
        tmp_path / "model.gguf", architecture=architecture, block_count=LAYERS, weight_type=Q.Q8_0
    ).path
    expected, _ = _decode(_engine(path, torch.float32, ahead=False), streams)
    engine = _engine(path, torch.float32)
    prompts = [Chunk(slot=s, start_position=0, length=len(PROMPT), token_ids=PROMPT, sample=True)
               for s in range(streams)]  # fmt: skip
    first = engine.step(prompts, None)
    got = [[first.tokens[s].token_id] for s in range(streams)]
    while min(len(tokens) for tokens in got) < STEPS:
        chunks = []
        for s in range(streams):
            draft = list(expected[s][len(got[s]) : len(got[s]) + 1 + s])
            if len(draft) > 1:
                draft[-1] = 1 if draft[-1] != 1 else 2
            chunks.append(Chunk(slot=s, start_position=len(PROMPT) + len(got[s]) - 1, length=1 + len(draft),
                                token_ids=(got[s][-1], *draft), sample=True, drafted=len(draft)))  # fmt: skip
        result = engine.step(chunks, None)
        for s in range(streams):
            got[s].extend(pick.token_id for pick in result.runs.get(s) or (result.tokens[s],))
    assert [tokens[:STEPS] for tokens in got] == [tokens[:STEPS] for tokens in expected]
    assert any(width > 1 for _, width in engine.decoder._captured), "no step of drafts was replayed from a graph"


def _compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far (the decode steps' blocks)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _compiled_kernels(*, attention_only: bool = False) -> int:
    """Kernels Triton has compiled in this process so far: the project's JIT functions' caches, on every device (or
    the attention kernel's alone)."""
    from strata.stage_worker.kernels import paged_attention_triton, quant_gemm_triton, quant_matmul_triton
    from triton.runtime.jit import JITFunction

    modules = (paged_attention_triton,) if attention_only else (paged_attention_triton, quant_gemm_triton,
                                                                quant_matmul_triton)  # fmt: skip
    functions = [value for module in modules for value in vars(module).values() if isinstance(value, JITFunction)]
    return sum(len(entry[0]) for fn in functions for entry in fn.device_caches.values())


@pytest.mark.parametrize(
    ("architecture", "weight_type"),
    [("llama", Q.Q8_0), ("llama", Q.Q4_K), ("gemma3", Q.Q8_0)],
    ids=["llama-Q8_0", "llama-Q4_K", "gemma3-Q8_0"],
)
def test_after_warm_up_no_step_shape_compiles(
    architecture: str, weight_type: GGMLQuantizationType, tmp_path: Path
) -> None:
    """Every batch of 1..parallel slots by 1..WIDEST rows a slot runs blocks and kernels the warm-up compiled: none
    compiles while serving (strata.stage_worker.warm_steps)."""
    from strata.stage_worker.decode import WIDEST

    shape = K_QUANT_SHAPE if weight_type == Q.Q4_K else None  # K-quant rows are 256 values a block
    path = write_test_model(
        tmp_path / "model.gguf", architecture=architecture, block_count=2, shape=shape, weight_type=weight_type
    ).path
    engine = _engine(path, torch.bfloat16)
    engine.warm_up()
    before = _compiled_kernels()
    assert before > 0, "the warm-up compiled no Triton kernel: the count below would prove nothing"
    graphs = _compiled_graphs()
    assert graphs > 0, "the warm-up compiled no block: the count below would prove nothing"
    for width in range(1, WIDEST + 1):
        for streams in range(1, engine.pool.parallel + 1):
            chunks = [Chunk(slot=s, start_position=0, length=2, token_ids=(5, 6)) for s in range(streams)]
            engine.step(chunks, None)  # a prompt's first positions: prefill, kernels of its own
            prefilled = _compiled_kernels()
            tokens = tuple(range(7, 7 + width))
            step = [Chunk(slot=s, start_position=2, length=width, token_ids=tokens, sample=True,
                          drafted=width - 1) for s in range(streams)]  # fmt: skip
            engine.step(step, None)
            assert _compiled_kernels() == prefilled, f"a step of {streams} slots by {width} rows compiled a kernel"
            assert _compiled_graphs() == graphs, f"a step of {streams} slots by {width} rows compiled a block"
            for s in range(streams):
                engine.pool.reset(s)


# (prompts, tokens each) of prefill steps: one prompt and a full batch, short and long, and a prompt beside decoding.
PREFILLS = [(1, 2), (1, 17), (1, 100), (2, 40), (3, 9), (4, 2), (4, 30)]


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_after_warm_up_no_prefill_step_compiles_attention(architecture: str, tmp_path: Path) -> None:
    """A step attends all its chunks in one launch, whose variant follows their number and the longest; the warm-up
    ran a prefill step of each (strata.stage_worker.warm_steps.prefill_shapes), so no batch of new prompts, and no
    prompt continued after a prefix, compiles the attention kernel while serving."""
    path = write_test_model(tmp_path / "model.gguf", architecture=architecture, block_count=2).path
    engine = _engine(path, torch.bfloat16)
    engine.warm_up()
    before = _compiled_kernels(attention_only=True)
    assert before > 0, "the warm-up compiled no attention kernel: the count below would prove nothing"
    for prompts, tokens in PREFILLS:
        fresh = [Chunk(slot=s, start_position=0, length=tokens, token_ids=(5,) * tokens, sample=True)
                 for s in range(prompts)]  # fmt: skip
        engine.step(fresh, None)
        continued = [Chunk(slot=s, start_position=tokens, length=3, token_ids=(6, 7, 8)) for s in range(prompts)]
        engine.step([*continued[:-1], replace(continued[-1], length=1, token_ids=(6,))], None)
        assert _compiled_kernels(attention_only=True) == before, f"{prompts} prompts of {tokens} compiled attention"
        for s in range(prompts):
            engine.pool.reset(s)


def test_a_long_fresh_prompt_attends_through_flash_attention_as_through_the_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone prompt of FLASH_MIN_ROWS rows or more from position 0 (Layout.fresh): the same first pick and
    log-probability as the pool kernel gives it, and the flash path really taken."""
    path = write_test_model(tmp_path / "model.gguf", architecture="llama", block_count=LAYERS, weight_type=Q.Q8_0).path
    prompt = tuple(
        torch.randint(1, 250, (model.FLASH_MIN_ROWS + 77,), generator=torch.Generator().manual_seed(0)).tolist()
    )
    calls = []
    fresh = paged_attention.attend_fresh

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return fresh(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(model, "attend_fresh", counted)

    def first_pick() -> tuple[int, float]:
        engine = _engine(path, torch.float32, context=2 * len(prompt))
        chunk = Chunk(slot=0, start_position=0, length=len(prompt), token_ids=prompt, sample=True)
        picked = engine.step([chunk], None).tokens[0]
        return picked.token_id, picked.logprob

    through_flash = first_pick()
    assert len(calls) == LAYERS, f"the prompt's layers attended through flash attention {len(calls)} times"
    monkeypatch.setattr(model, "FLASH_MIN_ROWS", 1 << 30)
    torch._dynamo.reset()
    through_pool = first_pick()
    assert len(calls) == LAYERS, "with the bound out of reach the pool kernel attends"
    assert through_flash[0] == through_pool[0]
    assert abs(through_flash[1] - through_pool[1]) < 1e-4, (through_flash, through_pool)


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_a_resident_window_decodes_in_compiled_graphs_as_eagerly(architecture: str, tmp_path: Path) -> None:
    """The window's compacted table written and its queries recorded inside captured, compiled steps (decoding ahead
    too): the same choices and tokens as the same window decoding eagerly on the same device."""
    layers = None if architecture == "gemma3" else LAYERS  # gemma3's one full-attention layer is its sixth
    path = write_test_model(tmp_path / "model.gguf", architecture=architecture, block_count=layers).path
    prompt = tuple(torch.randint(1, 250, (200,), generator=torch.Generator().manual_seed(1)).tolist())
    shape = ResidentShape(sinks=1, selected=2, recent=32, block=16)
    runs = {}
    for graphs in (True, False):
        device = torch.device("cuda")
        (stage,) = load_spans(path, dtype=torch.float32, device=device)
        c = stage.config
        pool = KVPool(
            n_layers=c.n_layer, context=512, parallel=2, key_width=c.kv_dim, value_width=c.kv_dim,
            type_k=CacheType.F32, type_v=CacheType.F32, dtype=torch.float32, device=device, block=16,
        )  # fmt: skip
        keep_resident(pool, c, layers=range(c.n_layer), shape=shape)
        engine = Engine(model=stage, pool=pool, device=device, dtype=torch.float32, cuda_graphs=graphs)
        result = engine.step([Chunk(slot=0, start_position=0, length=len(prompt), token_ids=prompt, sample=True)], None)
        tokens = [result.tokens[0].token_id]
        for position in range(len(prompt), len(prompt) + 48):
            result = engine.step([Chunk(slot=0, start_position=position, length=1, token_ids=(tokens[-1],),
                                        sample=True)], None)  # fmt: skip
            tokens.append(result.tokens[0].token_id)
        assert pool.resident is not None
        runs[graphs] = (tokens, pool.resident.choices, pool.resident.seen(0, len(prompt) + 48))
        torch._dynamo.reset()
    assert runs[True][1] > 0, "the window never chose: the comparison would prove nothing"
    assert runs[True] == runs[False]
