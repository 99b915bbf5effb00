"""`strata inspect MODEL [--json]`: what a GGUF model needs, read from its header alone.

A person checks a model before deploying it (layers, bytes per layer, KV bytes per token in each cache type, how
much was fetched to find out); `--json` gives the same to scripts. Weights are shown twice where the figures differ:
their size in the file (what a download costs) and on GPUs once loaded (what a plan must fit; strata.gguf.resident).
Bad input exits 1 with the typed error's message.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gguf import GGMLQuantizationType
from strata.gguf.errors import GGUFError
from strata.gguf.model import CacheType, ModelInfo
from strata.gguf.reader import inspect_model
from strata.gguf.resident import kept_quantised
from strata.quantity import quantity_to_bytes

SHOWN_CACHE_TYPES = (CacheType.F16, CacheType.Q8_0, CacheType.Q4_0)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "inspect", help="read a GGUF model's header (path, file://, http(s)://, hf://ORG/REPO/FILE.gguf[@REV])"
    )
    parser.add_argument("model", metavar="MODEL", help="path or URL of a .gguf file")
    parser.add_argument(
        "--kv-host-memory",
        metavar="QUANTITY",
        help="also say how many tokens of KV (over all layers) this much host memory holds, as spec.kvCache.hostMemory",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        host_bytes = None if args.kv_host_memory is None else quantity_to_bytes(args.kv_host_memory)
    except ValueError as error:
        print(f"strata inspect: --kv-host-memory {error}", file=sys.stderr)
        return 1
    try:
        info = inspect_model(args.model)
    except GGUFError as error:
        print(f"strata inspect: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    if args.json:
        report = to_json(info)
        if host_bytes is not None:
            report["host_kv"] = {"bytes": host_bytes, "tokens": host_kv_tokens(info, host_bytes)}
        print(json.dumps(report, indent=2))
    else:
        print(to_table(info, host_bytes=host_bytes))
    return 0


def host_kv_tokens(info: ModelInfo, host_bytes: int) -> dict[str, int]:
    """Tokens of KV over every layer that `host_bytes` of host memory holds, per cache type (resident KV is the
    plan's: it depends on the GPUs and the context)."""
    return {t.value: host_bytes // info.kv_bytes_per_token(type_k=t, type_v=t) for t in SHOWN_CACHE_TYPES}


def to_json(info: ModelInfo) -> dict[str, Any]:
    window = info.sliding_window
    return {
        "name": info.name,
        "architecture": info.architecture,
        "executable": info.executable,
        "not_executable_reason": info.not_executable_reason,
        "block_count": info.block_count,
        "embedding_length": info.embedding_length,
        "head_count": info.head_count,
        "head_count_kv": list(info.head_count_kv),
        "key_length": info.key_length,
        "value_length": info.value_length,
        "context_length": info.context_length,
        "vocab_size": info.vocab_size,
        "expert_count": info.expert_count,
        "expert_used_count": info.expert_used_count,
        "rope": None if info.rope is None else vars(info.rope),
        "sliding_window": None if window is None else {"window": window.window, "layers": list(window.layers)},
        "layer_bytes": list(info.layer_bytes),
        "non_layer_bytes": info.non_layer_bytes,
        "output_tied": info.output_tied,
        "total_bytes": info.total_bytes,
        "layer_resident_bytes": list(info.layer_resident_bytes),
        "non_layer_resident_bytes": info.non_layer_resident_bytes,
        "resident_total_bytes": info.resident_total_bytes,
        "tensor_types": {name: {"tensors": n, "kept_quantised": _kept(name)} for name, n in info.tensor_types.items()},
        "kv_bytes_per_token": {t.value: info.kv_bytes_per_token(type_k=t, type_v=t) for t in CacheType},
        "tokenizer_model": info.tokenizer_model,
        "tokenizer_pre": info.tokenizer_pre,
        "has_chat_template": info.has_chat_template,
        "header_bytes": info.header_bytes,
        "header_bytes_read": info.header_bytes_read,
        "file_bytes": info.file_bytes,
    }


def _size(n: int | None) -> str:
    if n is None:
        return "unknown"
    return f"{n:,} B ({n / 2**30:.2f} GiB)" if n >= 2**30 else f"{n:,} B ({n / 2**20:.2f} MiB)"


def _weights(stored: int, resident: int) -> str:
    """File bytes, and what stages hold once loaded where that differs (dequantised types grow, F32 shrinks)."""
    if stored == resident:
        return _size(stored)
    return f"{_size(stored)} in the file, {_size(resident)} loaded"


def _kept(type_name: str) -> bool:
    return kept_quantised(GGMLQuantizationType[type_name])


def _types(counts: dict[str, int]) -> str:
    """Which tensor types a stage keeps in their blocks and which it holds as plain 2-byte values."""
    kept = [f"{name} x{n}" for name, n in sorted(counts.items()) if _kept(name)]
    plain = [f"{name} x{n}" for name, n in sorted(counts.items()) if not _kept(name)]
    parts = [f"{', '.join(kept)} kept in their blocks"] if kept else []
    return "; ".join([*parts, *([f"{', '.join(plain)} as plain values"] if plain else [])]) or "-"


def _executable(info: ModelInfo) -> str:
    """The same answer `strata serve` and the operator act on (strata.gguf.executable)."""
    reason = info.not_executable_reason
    return "executable" if reason is None else f"not executable by Strata: {reason}"


def to_table(info: ModelInfo, *, host_bytes: int | None = None) -> str:
    kv_heads = sorted(set(info.head_count_kv))
    rows = [
        ("name", info.name or "-"),
        ("architecture", f"{info.architecture} ({_executable(info)})"),
        ("layers", str(info.block_count)),
        ("embedding", str(info.embedding_length)),
        ("heads / kv heads", f"{info.head_count} / {','.join(map(str, kv_heads))}"),
        ("key / value length", f"{info.key_length} / {info.value_length}"),
        ("context", f"{info.context_length:,}"),
        ("vocabulary", f"{info.vocab_size:,} ({info.tokenizer_model or '-'}, pre {info.tokenizer_pre or '-'})"),
        ("chat template", "yes" if info.has_chat_template else "no"),
    ]
    if info.expert_count:
        rows.append(("experts", f"{info.expert_used_count} of {info.expert_count}"))
    if info.sliding_window is not None:
        sliding = sum(info.sliding_window.layers)
        rows.append(("sliding window", f"{info.sliding_window.window} tokens on {sliding} of {info.block_count}"))
    rows += [
        ("layer weights", _weights(sum(info.layer_bytes), sum(info.layer_resident_bytes))),
        ("  max per layer", _weights(max(info.layer_bytes), max(info.layer_resident_bytes))),
        *(
            (f"  {role}", _weights(n, info.non_layer_resident_bytes.get(role, n)))
            for role, n in info.non_layer_bytes.items()
        ),
        ("output head", "tied to token_embd" if info.output_tied else "own tensor"),
        ("tensor types", _types(info.tensor_types)),
        ("total weights", _weights(info.total_bytes, info.resident_total_bytes)),
        *((f"KV/token {t.value}", f"{info.kv_bytes_per_token(type_k=t, type_v=t):,} B") for t in SHOWN_CACHE_TYPES),
        *(
            [("host KV", ", ".join(f"{n:,} tokens {t}" for t, n in host_kv_tokens(info, host_bytes).items()))]
            if host_bytes is not None
            else []
        ),
        ("header", f"{_size(info.header_bytes)}; fetched {_size(info.header_bytes_read)} of {_size(info.file_bytes)}"),
    ]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)
