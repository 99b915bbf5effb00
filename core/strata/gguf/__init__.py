"""Reading GGUF model files: the header, the typed model description, and test-model generation."""

from strata.gguf.describe import describe
from strata.gguf.errors import (
    AccessDeniedError,
    GatedModelError,
    GGUFError,
    GGUFFormatError,
    MetadataError,
    ModelNotFoundError,
    RangeNotSupportedError,
    SourceError,
    TLSError,
    UnreachableError,
)
from strata.gguf.executable import EXECUTABLE_ARCHITECTURES, NotExecutableError, check_executable, not_executable_reason
from strata.gguf.header import GGUFHeader, TensorInfo, read_header
from strata.gguf.limits import Limits
from strata.gguf.model import CacheType, ModelInfo, RopeSettings, SlidingWindow, row_bytes
from strata.gguf.reader import inspect_model, read_model_header

__all__ = [
    "EXECUTABLE_ARCHITECTURES",
    "AccessDeniedError",
    "CacheType",
    "GGUFError",
    "GGUFFormatError",
    "GGUFHeader",
    "GatedModelError",
    "Limits",
    "MetadataError",
    "ModelInfo",
    "ModelNotFoundError",
    "NotExecutableError",
    "RangeNotSupportedError",
    "RopeSettings",
    "SlidingWindow",
    "SourceError",
    "TLSError",
    "TensorInfo",
    "UnreachableError",
    "check_executable",
    "describe",
    "inspect_model",
    "not_executable_reason",
    "read_header",
    "read_model_header",
    "row_bytes",
]
