"""Generated GGUF models: small executable ones with a real tokenizer, and header-only copies of large ones.

Product code, not test scaffolding: `strata serve` can serve a generated demo model, and tests on every component
use these files instead of downloaded weights.
"""

from strata.gguf.testmodels.shapes import LARGE_SHAPES, SMALL_SHAPES, ModelShape, bench_llama, tensor_plan
from strata.gguf.testmodels.writer import WrittenModel, WrittenTensor, write_header_only_model, write_test_model

__all__ = [
    "LARGE_SHAPES",
    "SMALL_SHAPES",
    "ModelShape",
    "WrittenModel",
    "WrittenTensor",
    "bench_llama",
    "tensor_plan",
    "write_header_only_model",
    "write_test_model",
]
