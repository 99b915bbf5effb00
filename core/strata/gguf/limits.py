"""Upper bounds on every count and length a GGUF header may declare.

A header states its own sizes (2^60 tensors, a 1 GB string) before the bytes that would back them. Each bound here
is checked before the reader allocates or fetches anything, so a hostile file fails fast in bounded memory. The
defaults are a generous multiple of the largest real models (a 262k-token vocabulary, a few thousand tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class Limits:
    max_header_bytes: int = 256 * MiB  # everything before the tensor data
    max_kv_count: int = 1 << 16
    max_tensor_count: int = 1 << 20
    max_string_bytes: int = 16 * MiB  # one string: a key, a value, a tensor name, one array element
    max_array_count: int = 1 << 24
    max_dims: int = 4  # GGML_MAX_DIMS
    max_tensor_elements: int = 1 << 50
    first_window: int = 64 * 1024  # bytes requested first; each further request doubles, up to max_window
    max_window: int = 64 * MiB


DEFAULT_LIMITS = Limits()
