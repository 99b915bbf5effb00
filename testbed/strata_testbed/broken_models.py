"""Model files that read and plan but cannot load, for the tests that make a stage fail.

A download that stopped early leaves a GGUF file whose header is whole and whose tensor data is cut short: the header
inspects and plans (DESIGN.md asks that a file truncated after its tensor infos still inspect), and only a stage
reading the missing tensors can tell.
"""

from __future__ import annotations

from pathlib import Path

from strata.gguf import read_model_header


def cut_tensor_data(model: Path, path: Path, *, keep: float = 0.5) -> Path:
    """A copy of `model` at `path` holding its whole header and only the first `keep` of its tensor data."""
    header, _size = read_model_header(str(model))
    data = model.read_bytes()
    end = header.data_offset + int((len(data) - header.data_offset) * keep)
    path.write_bytes(data[:end])
    return path
