"""Reading GGUF model files: the header, the typed model description, and test-model generation."""

from strata.gguf.describe import EXECUTABLE_ARCHITECTURES, describe
from strata.gguf.errors import GGUFError, GGUFFormatError, MetadataError, RangeNotSupportedError, SourceError
from strata.gguf.header import GGUFHeader, TensorInfo, read_header
from strata.gguf.limits import Limits
from strata.gguf.model import CacheType, ModelInfo, RopeSettings, SlidingWindow, row_bytes
from strata.gguf.reader import inspect_model, read_model_header

__all__ = [
    "EXECUTABLE_ARCHITECTURES",
    "CacheType",
    "GGUFError",
    "GGUFFormatError",
    "GGUFHeader",
    "Limits",
    "MetadataError",
    "ModelInfo",
    "RangeNotSupportedError",
    "RopeSettings",
    "SlidingWindow",
    "SourceError",
    "TensorInfo",
    "describe",
    "inspect_model",
    "read_header",
    "read_model_header",
    "row_bytes",
]
