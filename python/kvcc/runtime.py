"""kvcc.Runtime: one model's paged INT2 KV cache and its append / decode / prefill kernels.

CPU tensors use a host pool (the CPU reference kernels); CUDA tensors a device pool (the CUDA
kernels, Hopper GPUs). Shapes and semantics are runtime/kvcc_runtime.h's:

    rt.begin_append(seqs, counts)     # grows the sequences (all or nothing; CacheFull)
    for layer in range(n_layers):
        out = rt.prefill(layer, seq, q, k, v)   # optional: T new tokens of one sequence
        rt.append(layer, k, v)        # k, v [sum(counts), n_kv, d], post-RoPE, unrotated
        out = rt.decode(layer, seqs, q)          # q [n_seqs, n_heads, d]
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Sequence

import torch

from . import _lib
from ._lib import KvccError
from .artifact import ArtifactInfo, load_artifact

__all__ = ["Runtime"]

# torch dtype -> kvcc_activations (runtime/kvcc_c.h)
_ACTIVATIONS = {torch.float32: 0, torch.bfloat16: 1}


def _int(name: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise KvccError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise KvccError(f"{name} must be >= {minimum}, got {value}")
    return value


def _tensors(**named: Any) -> None:
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise KvccError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _int_list(name: str, values: Sequence[int]) -> list[int]:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    try:
        out = list(values)
    except TypeError:
        raise KvccError(f"{name} must be a list of ints") from None
    return [_int(f"{name}[{i}]", v) for i, v in enumerate(out)]


class Runtime:
    """One model's kvcc cache. The shape arguments default to the artifact's; an engine passes its
    own, and an artifact that disagrees is refused. rank/ranks: tensor-parallel slice of the KV
    heads (tensors then hold the slice's heads only). max_context > 0 declares the engine's maxima
    (max_batch sequences a step, 0: max_sequences; max_step_tokens new tokens a step, 0:
    max_batch): a device pool then sizes everything at load and a step's append + decode calls
    can be captured in a CUDA graph and replayed after each later begin_append; a step beyond
    them is refused (kvcc_runtime.h). dtype: what the kernels take and return, torch.float32 or
    torch.bfloat16 (a bfloat16 model's tensors then pass without conversion); tensors of another
    dtype are converted to it, and outputs come back in q's dtype."""

    def __init__(
        self,
        path: str | os.PathLike,
        n_layers: int | None = None,
        n_heads: int | None = None,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        *,
        max_pages: int,
        max_sequences: int,
        device: str | torch.device = "cpu",
        rank: int = 0,
        ranks: int = 1,
        max_batch: int = 0,
        max_context: int = 0,
        max_step_tokens: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self._ptr: int | None = None
        self.handle: int = -1
        self.info: ArtifactInfo = load_artifact(path)
        self.path = self.info.path
        shape = {
            "n_layers": self.info.n_layers if n_layers is None else n_layers,
            "n_heads": self.info.n_heads if n_heads is None else n_heads,
            "n_kv_heads": self.info.n_kv_heads if n_kv_heads is None else n_kv_heads,
            "head_dim": self.info.head_dim if head_dim is None else head_dim,
        }
        for k, v in shape.items():
            _int(k, v, 1)
        _int("max_pages", max_pages)
        _int("max_sequences", max_sequences, 1)
        _int("rank", rank)
        _int("ranks", ranks, 1)
        for name, value in (("max_batch", max_batch), ("max_context", max_context),
                            ("max_step_tokens", max_step_tokens)):
            _int(name, value)
        if dtype not in _ACTIVATIONS:
            raise KvccError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
        dev = torch.device(device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise KvccError("device cuda asked for, but torch sees no CUDA device")
            dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
            memory = 1
        elif dev.type == "cpu":
            memory = 0
        else:
            raise KvccError(f"device must be cpu or cuda, got {dev}")
        self.device = dev
        self.dtype = dtype
        ptr = ctypes.c_void_p()
        with self._on_device():
            _lib.check(
                _lib.lib().kvcc_runtime_load_limits(
                    os.fsencode(self.path), shape["n_layers"], shape["n_heads"], shape["n_kv_heads"],
                    shape["head_dim"], max_pages, max_sequences, memory, rank, ranks, max_batch, max_context,
                    max_step_tokens, _ACTIVATIONS[dtype], ctypes.byref(ptr),
                )
            )
        self._ptr = ptr.value
        self.model_shape = shape
        self.rank, self.ranks = rank, ranks
        self.n_layers = shape["n_layers"]
        self.head_dim = shape["head_dim"]
        self.n_kv_heads = shape["n_kv_heads"] // ranks  # the slice's (the load checked divisibility)
        self.n_heads = shape["n_heads"] // ranks
        self.max_pages, self.max_sequences = max_pages, max_sequences
        # The ops declare that append mutates this counter (appends so far), so a compiled graph
        # keeps every append and orders decode / prefill (which read it) after them.
        self.state = torch.zeros(1, dtype=torch.int64, device=dev)
        self._rows: int | None = None  # rows append takes in the open step (None: no step)
        self._counts: dict[int, int] = {}

        from . import ops

        self.handle = ops._register(self)

    # -- plumbing ------------------------------------------------------------------------------
    def _on_device(self):
        if self.device.type == "cuda" and torch.cuda.current_device() != self.device.index:
            return torch.cuda.device(self.device)
        import contextlib

        return contextlib.nullcontext()

    def _stream(self) -> int | None:
        if self.device.type != "cuda":
            return None
        return torch.cuda.current_stream(self.device).cuda_stream

    def _p(self) -> int:
        if self._ptr is None:
            raise KvccError("the runtime is closed")
        return self._ptr

    def _tensor(self, name: str, t: Any, shape: tuple[int, ...], device: bool = True) -> None:
        _tensors(**{name: t})
        if not t.is_floating_point():
            raise KvccError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if device and t.device != self.device:
            raise KvccError(f"{name} is on {t.device}, the runtime's pool on {self.device}")
        if tuple(t.shape) != shape:
            raise KvccError(f"{name} has shape {tuple(t.shape)}, expected {shape}")

    def _act(self, name: str, t: torch.Tensor) -> torch.Tensor:
        # What the C ABI was loaded to take (self.dtype), contiguous.
        x = t.detach().to(self.dtype).contiguous()
        # NaN/Inf would silently poison a page's scale; checked on the host pool only, since on
        # a GPU the check would synchronise every call.
        if x.device.type == "cpu" and x.numel() and not bool(torch.isfinite(x).all()):
            raise KvccError(f"{name} holds NaN or Inf")
        return x

    def _check_seq(self, seq: Any) -> int:
        return _int("seq", seq)

    # -- sequences -----------------------------------------------------------------------------
    def add_sequence(self) -> int:
        out = ctypes.c_int()
        _lib.check(_lib.lib().kvcc_add_sequence(self._p(), ctypes.byref(out)))
        return out.value

    def fork(self, seq: int) -> int:
        """A new sequence sharing seq's pages (its windows copied)."""
        out = ctypes.c_int()
        with self._on_device():
            _lib.check(_lib.lib().kvcc_fork_sequence(self._p(), self._check_seq(seq), ctypes.byref(out),
                                                     self._stream()))
        return out.value

    def free(self, seq: int) -> None:
        _lib.check(_lib.lib().kvcc_free_sequence(self._p(), self._check_seq(seq)))

    def length(self, seq: int) -> int:
        out = ctypes.c_int64()
        _lib.check(_lib.lib().kvcc_sequence_length(self._p(), self._check_seq(seq), ctypes.byref(out)))
        return int(out.value)

    def evict(self, seq: int, kept: Sequence[int]) -> int:
        """Keeps only the token positions `kept` (ascending, distinct, < length) of `seq` and compacts
        them into whole pages (Runtime::evict_tokens: re-tiered as if appended alone; rows leaving
        INT2 history for a BF16 window are dequantised). Returns the pages returned to the pool.
        Not inside an open step."""
        ks = [int(t) for t in kept]
        n = len(ks)
        out = ctypes.c_int64()
        _lib.check(_lib.lib().kvcc_evict_tokens(self._p(), self._check_seq(seq), n, (ctypes.c_int64 * max(n, 1))(*ks),
                                                self._stream(), ctypes.byref(out)))
        return int(out.value)

    def bytes_in_use(self) -> int:
        out = ctypes.c_int64()
        _lib.check(_lib.lib().kvcc_bytes_in_use(self._p(), ctypes.byref(out)))
        return int(out.value)

    # -- a step --------------------------------------------------------------------------------
    def begin_append(self, seqs: Sequence[int], counts: Sequence[int]) -> None:
        """Grows each sequence by its count (pages allocated all or nothing; raises CacheFull)."""
        s, c = _int_list("seqs", seqs), _int_list("counts", counts)
        if len(s) != len(c):
            raise KvccError(f"begin_append: {len(s)} sequences but {len(c)} counts")
        if len(set(s)) != len(s):
            raise KvccError(f"begin_append: a sequence is listed twice in {s}")
        n = len(s)
        with self._on_device():
            _lib.check(_lib.lib().kvcc_begin_append_stream(
                self._p(), n, (ctypes.c_int * n)(*s), (ctypes.c_int * n)(*c), self._stream()))
        self._rows = sum(c)
        self._counts = dict(zip(s, c))

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        _tensors(k=k, v=v)
        torch.ops.kvcc.append(self.handle, self.state, layer, k, v)

    def decode(self, layer: int, seqs: Sequence[int], q: torch.Tensor) -> torch.Tensor:
        _tensors(q=q)
        return torch.ops.kvcc.decode(self.handle, self.state, layer, _int_list("seqs", seqs), q)

    def prefill(self, layer: int, seq: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        _tensors(q=q, k=k, v=v)
        return torch.ops.kvcc.prefill(self.handle, self.state, layer, seq, q, k, v)

    # -- what the ops run (ops.py) ---------------------------------------------------------------
    def _check_append(self, layer: int, k: torch.Tensor, v: torch.Tensor, device: bool = True) -> None:
        self._p()
        _int("layer", layer)
        if layer >= self.n_layers:
            raise KvccError(f"layer {layer} out of range (the model has {self.n_layers})")
        if self._rows is None:
            raise KvccError("append before begin_append: open a step first")
        shape = (self._rows, self.n_kv_heads, self.head_dim)
        self._tensor("k", k, shape, device)
        self._tensor("v", v, shape, device)

    def _append_impl(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._check_append(layer, k, v)
        ka, va = self._act("k", k), self._act("v", v)
        with self._on_device():
            _lib.check(_lib.lib().kvcc_append(self._p(), layer, ka.data_ptr(), va.data_ptr(), self._stream()))

    def _check_decode(self, layer: int, seqs: list[int], q: torch.Tensor, device: bool = True) -> None:
        self._p()
        _int("layer", layer)
        if layer >= self.n_layers:
            raise KvccError(f"layer {layer} out of range (the model has {self.n_layers})")
        self._tensor("q", q, (len(seqs), self.n_heads, self.head_dim), device)

    def _decode_impl(self, layer: int, seqs: list[int], q: torch.Tensor) -> torch.Tensor:
        self._check_decode(layer, seqs, q)
        qa = self._act("q", q)
        out = torch.empty(qa.shape, dtype=self.dtype, device=self.device)
        n = len(seqs)
        if n:
            with self._on_device():
                _lib.check(_lib.lib().kvcc_decode(self._p(), layer, n, (ctypes.c_int * n)(*seqs), qa.data_ptr(),
                                                  out.data_ptr(), self._stream()))
        return out if q.dtype == self.dtype else out.to(q.dtype)

    def _check_prefill(self, layer: int, seq: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       device: bool = True) -> None:
        self._p()
        _int("layer", layer)
        _int("seq", seq)
        if layer >= self.n_layers:
            raise KvccError(f"layer {layer} out of range (the model has {self.n_layers})")
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            raise KvccError("q must be a tensor [T, n_heads, head_dim]")
        T = int(q.shape[0])
        self._tensor("q", q, (T, self.n_heads, self.head_dim), device)
        self._tensor("k", k, (T, self.n_kv_heads, self.head_dim), device)
        self._tensor("v", v, (T, self.n_kv_heads, self.head_dim), device)

    def _prefill_impl(self, layer: int, seq: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self._check_prefill(layer, seq, q, k, v)
        qa, ka, va = self._act("q", q), self._act("k", k), self._act("v", v)
        out = torch.empty(qa.shape, dtype=self.dtype, device=self.device)
        T = int(q.shape[0])
        if T:
            with self._on_device():
                _lib.check(_lib.lib().kvcc_prefill(self._p(), layer, seq, T, qa.data_ptr(), ka.data_ptr(),
                                                   va.data_ptr(), out.data_ptr(), self._stream()))
        return out if q.dtype == self.dtype else out.to(q.dtype)

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        ptr, self._ptr = self._ptr, None
        if ptr is not None:
            from . import ops

            ops._unregister(self.handle)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # no kernel of ours may still read the pool
            _lib.lib().kvcc_runtime_free(ptr)

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass  # interpreter shutdown: modules may already be gone

    def __repr__(self) -> str:
        state = "closed" if self._ptr is None else f"{self.device}"
        return (f"kvcc.Runtime({self.info.method} {self.info.key_bits:g}/{self.info.value_bits:g} bits, "
                f"layers {getattr(self, 'n_layers', '?')}, {state})")
