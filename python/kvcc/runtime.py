"""kvcc.Runtime: one model's paged INT2 KV cache and its append / decode / prefill kernels.

CPU tensors use a host pool (the CPU reference kernels); CUDA tensors a device pool (the CUDA
kernels, Hopper GPUs). Shapes and semantics are runtime/kvcc_runtime.h's:

    rt.begin_append(seqs, counts)     # grows the sequences (all or nothing; CacheFull)
    for layer in range(n_layers):
        out = rt.prefill(layer, seq, q, k, v)   # optional: T new tokens of one sequence, or
        out = rt.prefill(layer, seqs, q, k, v, counts=counts)   # of several in one launch
        rt.append(layer, k, v)        # k, v [sum(counts), n_kv, d], post-RoPE, unrotated
        out = rt.decode(layer, seqs, q)          # q [n_seqs, n_heads, d]

An engine that keeps its own page tables (engine_tables=True; vLLM / FlashInfer block tables):

    rt.begin_step(slots, lengths, counts, block_table, rows)   # int32 tensors on rt.device
    for layer in range(n_layers):
        out = rt.prefill_engine(layer, slot, length, pages, q, k, v)   # optional (or lists of
                                                                       # slots, lengths, pages, counts=)
        rt.append(layer, k, v)        # k, v [rows, n_kv, d]
        out = rt.decode_step(layer, q)           # q [batch, n_heads, d]
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
    dtype are converted to it, and outputs come back in q's dtype. engine_tables=True: the
    engine keeps the page tables (runtime/engine_step.h): it gives each sequence a window slot in
    [0, max_sequences) and kvcc.pages_for_tokens(rt, n) pool pages in [0, max_pages) for n tokens,
    and opens steps with begin_step; the Runtime's own sequences (add_sequence, begin_append,
    decode, prefill, fork, evict) are refused. It needs the maxima (max_context > 0)."""

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
        engine_tables: bool = False,
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
        if not isinstance(engine_tables, bool):
            raise KvccError(f"engine_tables must be a bool, got {type(engine_tables).__name__}")
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
        load = _lib.lib().kvcc_runtime_load_engine if engine_tables else _lib.lib().kvcc_runtime_load_limits
        with self._on_device():
            _lib.check(
                load(
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
        self.max_context = max_context
        # The declared maxima as the library resolves them (0 without max_context: no bound declared).
        self.max_batch = (max_batch or max_sequences) if max_context else 0
        self.max_step_tokens = (max_step_tokens or self.max_batch) if max_context else 0
        self.engine_tables = engine_tables
        # The ops declare that append mutates this counter (appends so far), so a compiled graph
        # keeps every append and orders decode / prefill (which read it) after them.
        self.state = torch.zeros(1, dtype=torch.int64, device=dev)
        self._rows: int | None = None  # rows append takes in the open step (None: no step)
        self._batch = 0  # sequences of the open step (decode_step's q rows)
        self._counts: dict[int, int] = {}
        self._tables: tuple[torch.Tensor, ...] = ()  # the open engine step's (its kernels read them)

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

    def attention_scores(self, layer: int, seq: int, q: torch.Tensor) -> torch.Tensor:
        """SnapKV's token scores read from the cache (Runtime::attention_scores): q [W, n_heads, d]
        holds the queries of seq's last W tokens (post-RoPE, those tokens already appended); returns
        float32 [n_kv_heads, length] on the runtime's device, each position's softmax weights summed
        over the W queries and each KV head's query heads. Between steps only. Max-pool, keep the
        best, then evict()."""
        _tensors(q=q)
        if q.dim() != 3:
            raise KvccError(f"q must be [W, n_heads, head_dim], got shape {tuple(q.shape)}")
        self._tensor("q", q, (q.shape[0], self.n_heads, self.head_dim))
        x = self._act("q", q)
        out = torch.empty(self.n_kv_heads, self.length(seq), dtype=torch.float32, device=self.device)
        with self._on_device():
            _lib.check(_lib.lib().kvcc_attention_scores(self._p(), _int("layer", layer), self._check_seq(seq),
                                                        int(q.shape[0]), x.data_ptr(), out.data_ptr(),
                                                        self._stream()))
        return out

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
        self._rows, self._batch, self._tables = None, 0, ()  # a refused step leaves none open
        with self._on_device():
            _lib.check(_lib.lib().kvcc_begin_append_stream(
                self._p(), n, (ctypes.c_int * n)(*s), (ctypes.c_int * n)(*c), self._stream()))
        self._rows = sum(c)
        self._batch = n
        self._counts = dict(zip(s, c))
        self._tables = ()

    def begin_step(self, slots: torch.Tensor, lengths: torch.Tensor, counts: torch.Tensor,
                   block_table: torch.Tensor, rows: int | None = None) -> None:
        """Opens a step from the engine's tables (engine_tables=True): contiguous int32 tensors on
        the runtime's device, slots, lengths (tokens before the step) and counts (new tokens) of
        shape [batch], and block_table [batch, stride] (row i: sequence i's history pages; stride
        >= kvcc.pages_for_tokens(rt, max_context)). rows: the rows the step's k and v hold (the
        sequences' new tokens one after another; rows past sum(counts) are padding, never read);
        for CPU tensors it defaults to sum(counts), for CUDA ones it must be given (reading counts
        would synchronise). On CUDA a kernel on the current stream plans the step from the tables
        when it runs, so begin_step and every layer's append + decode_step capture in one CUDA
        graph, replayed after the engine writes the next step's values into the same tensors; a
        bad step there plans nothing and decodes zeros, and step_problem() names it (CPU tensors:
        KvccError, nothing changed). The tables must stay as they are until the step's last
        decode_step (the runtime keeps a reference)."""
        _tensors(slots=slots, lengths=lengths, counts=counts, block_table=block_table)
        if rows is None:
            if counts.device.type != "cpu":
                raise KvccError("begin_step: give rows (the rows of the step's k and v) with CUDA tables: "
                                "reading counts would synchronise the stream")
            rows = int(counts.sum())
        torch.ops.kvcc.begin_step(self.handle, self.state, slots, lengths, counts, block_table, _int("rows", rows))

    def step_problem(self) -> str:
        """Why the last begin_step planned nothing ("" when it planned): on CUDA it waits for the
        current stream (not inside a graph capture)."""
        msg = ctypes.c_char_p()
        with self._on_device():
            _lib.check(_lib.lib().kvcc_step_problem(self._p(), self._stream(), ctypes.byref(msg)))
        return (msg.value or b"").decode("utf-8", "replace")

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        _tensors(k=k, v=v)
        torch.ops.kvcc.append(self.handle, self.state, layer, k, v)

    def decode(self, layer: int, seqs: Sequence[int], q: torch.Tensor) -> torch.Tensor:
        _tensors(q=q)
        return torch.ops.kvcc.decode(self.handle, self.state, layer, _int_list("seqs", seqs), q)

    def prefill(self, layer: int, seqs: int | Sequence[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                counts: Sequence[int] | None = None) -> torch.Tensor:
        """New tokens attend to their sequence's cache and causally to each other. One sequence:
        prefill(layer, seq, q, k, v) with q [T, n_heads, d], k, v [T, n_kv, d]. Several in one set
        of launches (a ragged batch): seqs a list and counts[i] the rows of seqs[i], the sequences'
        rows one after another in q, k, v and out (for the open step's sequences in its order:
        append's k and v). Each sequence at most once."""
        _tensors(q=q, k=k, v=v)
        seqs, counts = self._batch_of("seqs", seqs, counts, q)
        return torch.ops.kvcc.prefill(self.handle, self.state, layer, seqs, counts, q, k, v)

    def decode_step(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Decode of the open step's sequences in its order (begin_step's or begin_append's):
        q, out [batch, n_heads, d]."""
        _tensors(q=q)
        return torch.ops.kvcc.decode_step(self.handle, self.state, layer, q)

    def prefill_engine(self, layer: int, slot: int | Sequence[int], length: int | Sequence[int],
                       pages: torch.Tensor | Sequence[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, counts: Sequence[int] | None = None) -> torch.Tensor:
        """prefill for sequences of the engine's tables: window slot `slot`, `length` tokens before
        the new ones, and pages (int32 on the runtime's device) its history pages
        (>= kvcc.pages_for_tokens(rt, length) of them). Several at once: lists of slots, lengths
        and pages, and counts (as prefill's). Inside a step that appends the tokens, call it
        before the layer's append, with the lengths the step starts from."""
        _tensors(q=q, k=k, v=v)
        slots, counts = self._batch_of("slot", slot, counts, q)
        lengths = [length] if isinstance(length, int) and not isinstance(length, bool) else _int_list("length", length)
        pages = [pages] if isinstance(pages, torch.Tensor) else list(pages)
        if len(lengths) != len(slots) or len(pages) != len(slots):
            raise KvccError(f"prefill_engine of {len(slots)} sequences with {len(lengths)} lengths and "
                            f"{len(pages)} page lists")
        _tensors(**{f"pages[{i}]": p for i, p in enumerate(pages)})
        return torch.ops.kvcc.prefill_engine(self.handle, self.state, layer, slots, lengths, pages, counts, q, k, v)

    @staticmethod
    def _batch_of(name: str, seqs: Any, counts: Sequence[int] | None, q: torch.Tensor) -> tuple[list[int], list[int]]:
        """(sequence ids, counts) of a prefill: one id with all of q's rows, or lists."""
        if isinstance(seqs, int) and not isinstance(seqs, bool):
            seqs = [seqs]
        else:
            seqs = _int_list(name, seqs)
        if counts is None:
            if len(seqs) != 1:
                raise KvccError(f"prefill of {len(seqs)} sequences needs counts (the new rows of each)")
            counts = [int(q.shape[0]) if q.dim() >= 1 else 0]
        return seqs, _int_list("counts", counts)

    # -- what the ops run (ops.py) ---------------------------------------------------------------
    def _check_append(self, layer: int, k: torch.Tensor, v: torch.Tensor, device: bool = True) -> None:
        self._p()
        _int("layer", layer)
        if layer >= self.n_layers:
            raise KvccError(f"layer {layer} out of range (the model has {self.n_layers})")
        if self._rows is None:
            raise KvccError("append without an open step: call begin_append (or begin_step) first")
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

    def _check_prefill(self, layer: int, seqs: list[int], counts: list[int], q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, device: bool = True) -> None:
        self._p()
        _int("layer", layer)
        if layer >= self.n_layers:
            raise KvccError(f"layer {layer} out of range (the model has {self.n_layers})")
        seqs, counts = _int_list("seqs", seqs), _int_list("counts", counts)
        if len(seqs) != len(counts):
            raise KvccError(f"prefill of {len(seqs)} sequences with {len(counts)} counts")
        if len(set(seqs)) != len(seqs):
            raise KvccError(f"prefill names a sequence twice: {seqs}")
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            raise KvccError("q must be a tensor [T, n_heads, head_dim]")
        T = sum(counts)
        if int(q.shape[0]) != T:
            raise KvccError(f"q has {int(q.shape[0])} rows; the counts sum to {T}")
        self._tensor("q", q, (T, self.n_heads, self.head_dim), device)
        self._tensor("k", k, (T, self.n_kv_heads, self.head_dim), device)
        self._tensor("v", v, (T, self.n_kv_heads, self.head_dim), device)

    def _prefill_impl(self, layer: int, seqs: list[int], counts: list[int], q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> torch.Tensor:
        self._check_prefill(layer, seqs, counts, q, k, v)
        qa, ka, va = self._act("q", q), self._act("k", k), self._act("v", v)
        out = torch.empty(qa.shape, dtype=self.dtype, device=self.device)
        n = len(seqs)
        if int(q.shape[0]):
            with self._on_device():
                _lib.check(_lib.lib().kvcc_prefill(self._p(), layer, n, (ctypes.c_int * n)(*seqs),
                                                   (ctypes.c_int * n)(*counts), qa.data_ptr(), ka.data_ptr(),
                                                   va.data_ptr(), out.data_ptr(), self._stream()))
        return out if q.dtype == self.dtype else out.to(q.dtype)

    def _check_tables(self, **named: torch.Tensor) -> None:
        for name, t in named.items():
            _tensors(**{name: t})
            if t.dtype != torch.int32:
                raise KvccError(f"{name} must be an int32 tensor, got {t.dtype}")
            if t.device != self.device:
                raise KvccError(f"{name} is on {t.device}, the runtime's pool on {self.device}")
            if not t.is_contiguous():
                raise KvccError(f"{name} must be contiguous")

    def _check_step(self, slots: torch.Tensor, lengths: torch.Tensor, counts: torch.Tensor,
                    block_table: torch.Tensor, rows: int) -> int:
        self._p()
        self._check_tables(slots=slots, lengths=lengths, counts=counts, block_table=block_table)
        if slots.dim() != 1:
            raise KvccError(f"slots must be a 1-D tensor [batch], got shape {tuple(slots.shape)}")
        batch = int(slots.shape[0])
        for name, t in (("lengths", lengths), ("counts", counts)):
            if tuple(t.shape) != (batch,):
                raise KvccError(f"{name} has shape {tuple(t.shape)}, expected ({batch},) as slots")
        if block_table.dim() != 2 or int(block_table.shape[0]) != batch:
            raise KvccError(f"block_table has shape {tuple(block_table.shape)}, expected [{batch}, stride]")
        _int("rows", rows)
        return batch

    def _begin_step_impl(self, slots: torch.Tensor, lengths: torch.Tensor, counts: torch.Tensor,
                         block_table: torch.Tensor, rows: int) -> None:
        batch = self._check_step(slots, lengths, counts, block_table, rows)
        # A step refused by the host pool leaves nothing open (the C++ call changes nothing either).
        self._rows, self._batch, self._tables = None, 0, ()
        with self._on_device():
            _lib.check(_lib.lib().kvcc_begin_step(
                self._p(), batch, slots.data_ptr(), lengths.data_ptr(), counts.data_ptr(), block_table.data_ptr(),
                int(block_table.shape[1]), rows, self._stream()))
        self._rows, self._batch = rows, batch
        self._counts = {}
        self._tables = (slots, lengths, counts, block_table)

    def _check_decode_step(self, layer: int, q: torch.Tensor, device: bool = True) -> None:
        self._p()
        _int("layer", layer)
        if layer >= self.n_layers:
            raise KvccError(f"layer {layer} out of range (the model has {self.n_layers})")
        if self._rows is None:
            raise KvccError("decode_step without an open step: call begin_step (or begin_append) first")
        self._tensor("q", q, (self._batch, self.n_heads, self.head_dim), device)

    def _decode_step_impl(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        self._check_decode_step(layer, q)
        qa = self._act("q", q)
        out = torch.empty(qa.shape, dtype=self.dtype, device=self.device)
        if self._batch:
            with self._on_device():
                _lib.check(_lib.lib().kvcc_decode_step(self._p(), layer, qa.data_ptr(), out.data_ptr(),
                                                       self._stream()))
        return out if q.dtype == self.dtype else out.to(q.dtype)

    def _check_prefill_engine(self, layer: int, slots: list[int], lengths: list[int], pages: list[torch.Tensor],
                              counts: list[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              device: bool = True) -> None:
        self._check_prefill(layer, slots, counts, q, k, v, device)
        lengths = _int_list("length", lengths)
        if len(lengths) != len(slots) or len(pages) != len(slots):
            raise KvccError(f"prefill_engine of {len(slots)} sequences with {len(lengths)} lengths and "
                            f"{len(pages)} page lists")
        from .artifact import pages_for_tokens

        for i, (length, p) in enumerate(zip(lengths, pages)):
            name = "pages" if len(pages) == 1 else f"pages[{i}]"
            if device:
                self._check_tables(**{name: p})
            if p.dim() != 1:
                raise KvccError(f"{name} must be a 1-D tensor of page ids, got shape {tuple(p.shape)}")
            need = pages_for_tokens(self.info, length)
            if int(p.shape[0]) < need:
                raise KvccError(f"{name} holds {int(p.shape[0])} page ids; a sequence of {length} tokens has {need}")

    def _prefill_engine_impl(self, layer: int, slots: list[int], lengths: list[int], pages: list[torch.Tensor],
                             counts: list[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self._check_prefill_engine(layer, slots, lengths, pages, counts, q, k, v)
        qa, ka, va = self._act("q", q), self._act("k", k), self._act("v", v)
        out = torch.empty(qa.shape, dtype=self.dtype, device=self.device)
        n = len(slots)
        if int(q.shape[0]):
            with self._on_device():
                _lib.check(_lib.lib().kvcc_prefill_engine(
                    self._p(), layer, n, (ctypes.c_int * n)(*slots), (ctypes.c_int64 * n)(*lengths),
                    (ctypes.c_void_p * n)(*(p.data_ptr() for p in pages)), (ctypes.c_int * n)(*counts),
                    qa.data_ptr(), ka.data_ptr(), va.data_ptr(), out.data_ptr(), self._stream()))
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
