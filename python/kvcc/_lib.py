"""ctypes binding of libkvcc_c.so (the C ABI of runtime/kvcc_c.h), loaded on first use.

The library is looked up in this order: the file named by the environment variable
KVCC_LIBRARY, then libkvcc_c.so in this package's folder (where `pip install ./python` puts it).
Modules that never call into the library (kvcc.calibrate, kvcc.zoo without a model directory)
import without it.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

__all__ = ["KvccError", "CacheFull", "lib", "check", "library_path"]

KVCC_OK, KVCC_ERROR, KVCC_CACHE_FULL, KVCC_BAD_ARGUMENT = 0, 1, 2, 3


class KvccError(RuntimeError):
    """An error reported by kvcc: a bad path, a corrupt or mismatched artifact, bad tensors."""


class CacheFull(KvccError):
    """begin_append found too few free pages or sequence slots (nothing was allocated)."""


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_path: str | None = None

_c_int_p = ctypes.POINTER(ctypes.c_int)
_c_i64_p = ctypes.POINTER(ctypes.c_int64)
_c_tensor_p = ctypes.c_void_p  # tensors are passed as raw addresses (host or device)
_rt_p = ctypes.c_void_p

# name -> (restype, argtypes), as declared in runtime/kvcc_c.h.
_SIGNATURES = {
    "kvcc_runtime_load_limits": (
        ctypes.c_int,
        [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int,
         ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
         ctypes.POINTER(_rt_p)],
    ),
    "kvcc_runtime_load_engine": (
        ctypes.c_int,
        [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int,
         ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
         ctypes.POINTER(_rt_p)],
    ),
    "kvcc_runtime_free": (None, [_rt_p]),
    "kvcc_add_sequence": (ctypes.c_int, [_rt_p, _c_int_p]),
    "kvcc_fork_sequence": (ctypes.c_int, [_rt_p, ctypes.c_int, _c_int_p, ctypes.c_void_p]),
    "kvcc_free_sequence": (ctypes.c_int, [_rt_p, ctypes.c_int]),
    "kvcc_sequence_length": (ctypes.c_int, [_rt_p, ctypes.c_int, _c_i64_p]),
    "kvcc_begin_append_stream": (ctypes.c_int, [_rt_p, ctypes.c_int, _c_int_p, _c_int_p, ctypes.c_void_p]),
    "kvcc_append": (ctypes.c_int, [_rt_p, ctypes.c_int, _c_tensor_p, _c_tensor_p, ctypes.c_void_p]),
    "kvcc_decode": (ctypes.c_int, [_rt_p, ctypes.c_int, ctypes.c_int, _c_int_p, _c_tensor_p, _c_tensor_p,
                                   ctypes.c_void_p]),
    "kvcc_prefill": (ctypes.c_int, [_rt_p, ctypes.c_int, ctypes.c_int, _c_int_p, _c_int_p, _c_tensor_p, _c_tensor_p,
                                    _c_tensor_p, _c_tensor_p, ctypes.c_void_p]),
    "kvcc_begin_step": (ctypes.c_int, [_rt_p, ctypes.c_int, _c_tensor_p, _c_tensor_p, _c_tensor_p, _c_tensor_p,
                                       ctypes.c_int, ctypes.c_int, ctypes.c_void_p]),
    "kvcc_decode_step": (ctypes.c_int, [_rt_p, ctypes.c_int, _c_tensor_p, _c_tensor_p, ctypes.c_void_p]),
    "kvcc_prefill_engine": (ctypes.c_int, [_rt_p, ctypes.c_int, ctypes.c_int, _c_int_p, _c_i64_p,
                                           ctypes.POINTER(ctypes.c_void_p), _c_int_p, _c_tensor_p, _c_tensor_p,
                                           _c_tensor_p, _c_tensor_p, ctypes.c_void_p]),
    "kvcc_step_problem": (ctypes.c_int, [_rt_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_char_p)]),
    "kvcc_bytes_in_use": (ctypes.c_int, [_rt_p, _c_i64_p]),
    "kvcc_evict_tokens": (ctypes.c_int, [_rt_p, ctypes.c_int, ctypes.c_int64, _c_i64_p, ctypes.c_void_p, _c_i64_p]),
    "kvcc_attention_scores": (ctypes.c_int, [_rt_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, _c_tensor_p,
                                             _c_tensor_p, ctypes.c_void_p]),
    "kvcc_last_error": (ctypes.c_char_p, []),
    "kvcc_version": (ctypes.c_char_p, []),
    "kvcc_artifact_describe": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]),
    "kvcc_model_fingerprint": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]),
    "kvcc_history_pages": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64, _c_i64_p]),
}


def _candidates() -> list[Path]:
    env = os.environ.get("KVCC_LIBRARY")
    if env:
        return [Path(env)]  # an explicit choice is never silently replaced by another copy
    return [Path(__file__).resolve().parent / "libkvcc_c.so"]


def lib() -> ctypes.CDLL:
    """The loaded library; raises KvccError saying where it looked when it cannot be loaded."""
    global _lib, _path
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        for cand in _candidates():
            if not cand.is_file():
                tried.append(f"{cand} (missing)")
                continue
            try:
                handle = ctypes.CDLL(str(cand))
            except OSError as e:
                tried.append(f"{cand} ({e})")
                continue
            missing = [n for n in _SIGNATURES if not hasattr(handle, n)]
            if missing:
                tried.append(f"{cand} (lacks {', '.join(missing)}: an older libkvcc_c.so?)")
                continue
            for name, (res, args) in _SIGNATURES.items():
                fn = getattr(handle, name)
                fn.restype = res
                fn.argtypes = args
            _lib, _path = handle, str(cand)
            return handle
        raise KvccError(
            "cannot load libkvcc_c.so: tried " + "; ".join(tried)
            + ". Install the package (pip install ./python) or set KVCC_LIBRARY to a built libkvcc_c.so"
        )


def library_path() -> str:
    lib()
    assert _path is not None
    return _path


def last_error() -> str:
    msg = lib().kvcc_last_error()
    return msg.decode("utf-8", "replace") if msg else ""


def check(status: int) -> None:
    """Raises the error of a kvcc_* status (KVCC_CACHE_FULL -> CacheFull)."""
    if status == KVCC_OK:
        return
    msg = last_error() or f"kvcc error (status {status})"
    if status == KVCC_CACHE_FULL:
        raise CacheFull(msg)
    raise KvccError(msg)


def call_json(fn_name: str, path: str | os.PathLike) -> str:
    """Calls a kvcc_*(path, const char** json) function and returns the JSON text."""
    out = ctypes.c_char_p()
    check(getattr(lib(), fn_name)(os.fsencode(os.fspath(path)), ctypes.byref(out)))
    return (out.value or b"").decode("utf-8")


def version() -> str:
    return lib().kvcc_version().decode()
