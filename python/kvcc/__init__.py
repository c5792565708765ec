"""kvcc: load compiled KV-cache artifacts and serve a paged ~2-bit KV cache from PyTorch.

    import kvcc
    info = kvcc.load_artifact("model.kvcc.h5")
    rt = kvcc.Runtime(info.path, max_pages=1024, max_sequences=8, device="cuda")

The shared library (libkvcc_c.so) loads on first use and torch is imported only by kvcc.Runtime
and kvcc.ops, so kvcc.calibrate and kvcc.zoo work without them.
"""

from __future__ import annotations

from ._lib import CacheFull, KvccError
from ._version_info import __version__
from .artifact import ArtifactInfo, load_artifact, pages_for_tokens

__all__ = ["__version__", "ArtifactInfo", "CacheFull", "KvccError", "Runtime", "load_artifact", "pages_for_tokens",
           "library_version"]


def library_version() -> str:
    """The version libkvcc_c.so was built as (equals __version__ for a consistent install)."""
    from . import _lib

    return _lib.version()


def __getattr__(name: str):
    # torch is imported on first use of the runtime, not by `import kvcc`.
    if name == "Runtime":
        from .runtime import Runtime

        return Runtime
    if name in ("ops", "runtime", "zoo", "artifact", "hf", "generate", "bench_generate", "calibrate"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'kvcc' has no attribute {name!r}")
