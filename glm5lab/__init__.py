"""glm5lab: serve GLM-5 (MLA + DSA sparse indexer) from GGUF in vLLM where no sparse-MLA backend exists.

Folders follow the story of the notebooks:
  gguf/         01  read, write, inspect, split and merge GLM-5 GGUF files (needs gguf only)
  model/            the tiny GLM-5-shaped model every notebook and test runs on
  vllm_plugin/  02, 03, 05  the one wing that imports vLLM: loader fixes, backend doctor,
                the TRITON_MLA_SPARSE backend, the indexer op (imported lazily)
  sparse/       04  top-k -> global slots -> virtual block table, torch references
  kernels/      04, 05  Triton kernels (paged decode, fused sparse MLA, DSA indexer)
  bench/        05, 06  benchmarks, accuracy, roofline and projections
"""
from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("glm5lab")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+source"

from glm5lab.errors import Glm5labError  # noqa: E402

__all__ = ["__version__", "Glm5labError"]
