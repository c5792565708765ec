"""The runtime's calls as PyTorch custom ops: torch.ops.kvcc.append / decode / prefill, and for
an engine's own tables begin_step / decode_step / prefill_engine.

Each takes the runtime's integer handle (Runtime.handle) and its state tensor (Runtime.state, a
counter of appends and steps): append and begin_step declare that they mutate the state, the
others read it, so torch.compile neither drops an append or a step (they return nothing) nor
moves a read before them. Fake
implementations give output shapes without running anything (torch.compile, FakeTensor).
CUDA tensors run on torch.cuda.current_stream(); inputs are converted to the runtime's dtype
(Runtime.dtype: float32 or bfloat16, what its C ABI was loaded to take), contiguous, and outputs
back to q's dtype.
"""

from __future__ import annotations

import itertools
import threading
import weakref

import torch

from ._lib import KvccError

__all__ = ["append", "decode", "prefill", "begin_step", "decode_step", "prefill_engine"]

_lock = threading.Lock()
_next = itertools.count(1)
# Weak: a Runtime nobody holds is freed (its __del__ closes it) even though its ops know it.
_runtimes: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()


def _register(rt: object) -> int:
    with _lock:
        h = next(_next)
        _runtimes[h] = rt
        return h


def _unregister(handle: int) -> None:
    with _lock:
        _runtimes.pop(handle, None)


def _get(handle: int):
    rt = _runtimes.get(handle)
    if rt is None:
        raise KvccError(f"no open kvcc runtime has handle {handle} (closed?)")
    return rt


def _fake_check(handle, **named) -> None:
    # What tracing can check (ints and leading sizes may be symbolic there): each tensor's heads
    # and head_dim. The real kernels check everything.
    rt = _runtimes.get(handle) if isinstance(handle, int) else None  # a symbolic handle: no check
    if rt is None:
        return
    for name, (t, which) in named.items():
        heads = getattr(rt, which)
        if t.dim() != 3 or t.shape[1] != heads or t.shape[2] != rt.head_dim:
            raise KvccError(f"{name} has shape {tuple(t.shape)}, expected [*, {heads}, {rt.head_dim}]")


@torch.library.custom_op("kvcc::append", mutates_args=("state",))
def append(handle: int, state: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Writes the open step's new tokens of one layer into the cache (rotated, windows, INT2 pages)."""
    _get(handle)._append_impl(layer, k, v)
    state.add_(1)


@append.register_fake
def _append_fake(handle: int, state: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    _fake_check(handle, k=(k, "n_kv_heads"), v=(v, "n_kv_heads"))
    return None


@torch.library.custom_op("kvcc::decode", mutates_args=())
def decode(handle: int, state: torch.Tensor, layer: int, seqs: list[int], q: torch.Tensor) -> torch.Tensor:
    """One query token per sequence attends to its whole cache: q, out [n_seqs, n_heads, d]."""
    return _get(handle)._decode_impl(layer, seqs, q)


@decode.register_fake
def _decode_fake(handle: int, state: torch.Tensor, layer: int, seqs: list[int], q: torch.Tensor) -> torch.Tensor:
    _fake_check(handle, q=(q, "n_heads"))
    return q.new_empty(q.shape)


@torch.library.custom_op("kvcc::prefill", mutates_args=())
def prefill(handle: int, state: torch.Tensor, layer: int, seqs: list[int], counts: list[int], q: torch.Tensor,
            k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """New tokens of several sequences (counts[i] rows of seqs[i], one after another) attend to
    their caches and causally to themselves: q, out [sum(counts), n_heads, d]."""
    return _get(handle)._prefill_impl(layer, seqs, counts, q, k, v)


@prefill.register_fake
def _prefill_fake(handle: int, state: torch.Tensor, layer: int, seqs: list[int], counts: list[int], q: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    _fake_check(handle, q=(q, "n_heads"), k=(k, "n_kv_heads"), v=(v, "n_kv_heads"))
    return q.new_empty(q.shape)


@torch.library.custom_op("kvcc::begin_step", mutates_args=("state",))
def begin_step(handle: int, state: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, counts: torch.Tensor,
               block_table: torch.Tensor, rows: int) -> None:
    """Opens a step from an engine's int32 tables (slots, lengths, counts [batch], block_table
    [batch, stride]); the step's k and v hold `rows` rows."""
    _get(handle)._begin_step_impl(slots, lengths, counts, block_table, rows)
    state.add_(1)


@begin_step.register_fake
def _begin_step_fake(handle: int, state: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                     counts: torch.Tensor, block_table: torch.Tensor, rows: int) -> None:
    return None


@torch.library.custom_op("kvcc::decode_step", mutates_args=())
def decode_step(handle: int, state: torch.Tensor, layer: int, q: torch.Tensor) -> torch.Tensor:
    """The open step's sequences, one query token each, in the step's order: q, out [batch, n_heads, d]."""
    return _get(handle)._decode_step_impl(layer, q)


@decode_step.register_fake
def _decode_step_fake(handle: int, state: torch.Tensor, layer: int, q: torch.Tensor) -> torch.Tensor:
    _fake_check(handle, q=(q, "n_heads"))
    return q.new_empty(q.shape)


@torch.library.custom_op("kvcc::prefill_engine", mutates_args=())
def prefill_engine(handle: int, state: torch.Tensor, layer: int, slots: list[int], lengths: list[int],
                   pages: list[torch.Tensor], counts: list[int], q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> torch.Tensor:
    """prefill for sequences of an engine's tables (window slot, length, history pages of each)."""
    return _get(handle)._prefill_engine_impl(layer, slots, lengths, pages, counts, q, k, v)


@prefill_engine.register_fake
def _prefill_engine_fake(handle: int, state: torch.Tensor, layer: int, slots: list[int], lengths: list[int],
                         pages: list[torch.Tensor], counts: list[int], q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor) -> torch.Tensor:
    _fake_check(handle, q=(q, "n_heads"), k=(k, "n_kv_heads"), v=(v, "n_kv_heads"))
    return q.new_empty(q.shape)
