"""Hugging Face transformers integration: the INT2 KV cache behind `model.generate(...)`.

Importing this module registers the attention implementation "kvcc"
(`transformers.AttentionInterface`) and its mask function. A model loaded with
`attn_implementation="kvcc"` then attends through a `KvccCache`: a transformers `Cache` backed by a
`kvcc.Runtime`, one runtime sequence per batch row. The runtime stores what the C++ runtime
stores (BF16 sink, INT2 pages, BF16 recent ring; keys and values rotated by the artifact's
rotations), so the model's attention is exactly the runtime's:

    import kvcc.hf
    model = kvcc.hf.from_pretrained("MODEL_DIR", artifact="model.kvcc.h5")
    out = model.generate(input_ids, max_new_tokens=64, do_sample=False)

or, with a model loaded by hand (`attn_implementation="kvcc"`):

    cache = kvcc.hf.KvccCache.for_model(model, "model.kvcc.h5", max_tokens=4096)
    model.generate(input_ids, max_new_tokens=64, **kvcc.hf.cache_kwargs(model, cache))

Per forward step the cache opens one runtime step at layer 0 (`begin_append` of every row by the
step's tokens). Each layer's attention then receives transformers' post-RoPE, unrotated q / k / v
in [batch, heads, T, head_dim] layout and runs, per the runtime's call order:
  T > 1 (prefill / a block):  prefill(layer, rows, q, k, v, counts) (all rows at once), then append(layer, k, v)
  T == 1 (decode):            append(layer, k, v), then decode(layer, rows, q)
Prefill reads the cache as it was before the step's tokens and the new tokens causally, as
`kvcc validate --cache runtime` does per block; decode reads the cache after the token is
appended (the new token in the BF16 ring). The runtime's softmax scale is 1/sqrt(head_dim); a
model whose attention scales differently is refused.

kvcc.hf.DecodeGraph(model, cache) replays each later decode step (the whole forward of one token
a row) from one CUDA graph, after the step is opened on the host; see its docstring.

Scope: decoder-only models whose attention calls `cache.update(k, v, layer_idx)` and then the
registered attention function (Llama, Mistral, Qwen2, Qwen3 and their relatives). Every batch row
must have the same length: padded batches (an attention mask with zeros) are refused, since the
runtime has no per-row mask. Beam search reorders rows by forking runtime sequences (pages are
shared by reference count); `crop` (assisted decoding) is not supported.
"""

from __future__ import annotations

import inspect
import math
import os
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

try:  # both 5.17 and 5.24 have it; kept optional so an older transformers still imports
    from transformers.masking_utils import AttentionMaskInterface
except ImportError:  # pragma: no cover
    AttentionMaskInterface = None

from .artifact import ArtifactInfo, load_artifact, pages_for_tokens
from ._lib import CacheFull, KvccError

__all__ = [
    "ATTN_IMPLEMENTATION",
    "DecodeGraph",
    "KvccCache",
    "ModelShape",
    "cache_kwargs",
    "check_artifact_for_model",
    "from_pretrained",
    "zoo_artifact",
    "kvcc_attention_forward",
    "model_shape",
]

ATTN_IMPLEMENTATION = "kvcc"
# Without an explicit max_tokens a cache sizes its page pool for this many tokens per row (or the
# model's max_position_embeddings when smaller): enough for generation tests and demos without
# reserving a 128K-token pool per row on an 8B model.
DEFAULT_MAX_TOKENS = 8192


class ModelShape:
    """The attention shape of a transformers model config, as the runtime needs it."""

    def __init__(self, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, max_position: int,
                 sliding_window: int | None):
        self.n_layers, self.n_heads, self.n_kv_heads, self.head_dim = n_layers, n_heads, n_kv_heads, head_dim
        self.max_position = max_position
        self.sliding_window = sliding_window

    def __repr__(self) -> str:
        return (f"ModelShape(layers={self.n_layers}, heads={self.n_heads}, kv_heads={self.n_kv_heads}, "
                f"head_dim={self.head_dim})")


def model_shape(config: Any) -> ModelShape:
    """Reads layers, query / KV heads, head_dim (explicit, or hidden / heads) from a config."""
    config = getattr(config, "get_text_config", lambda: config)()
    n_layers = int(config.num_hidden_layers)
    n_heads = int(config.num_attention_heads)
    n_kv = int(getattr(config, "num_key_value_heads", None) or n_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    max_position = int(getattr(config, "max_position_embeddings", 0) or 0)
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:  # Qwen2 records a window it does not use
        window = None
    return ModelShape(n_layers, n_heads, n_kv, int(head_dim), max_position, int(window) if window else None)


def check_artifact_for_model(info: ArtifactInfo, shape: ModelShape) -> None:
    """Raises KvccError naming the first field where the artifact's model differs from the model."""
    for name, art, mod in (("layers", info.n_layers, shape.n_layers),
                           ("KV heads", info.n_kv_heads, shape.n_kv_heads),
                           ("head_dim", info.head_dim, shape.head_dim),
                           ("query heads", info.n_heads, shape.n_heads)):
        if art != mod:
            model_id = info.model.get("model_id") or "?"
            raise KvccError(f"artifact {info.path} was compiled for another model ({model_id}): it has {art} {name}, "
                            f"the model has {mod}")


def _as_info(artifact: str | os.PathLike | ArtifactInfo) -> ArtifactInfo:
    return artifact if isinstance(artifact, ArtifactInfo) else load_artifact(artifact)


class _KvccLayer(CacheLayerMixin):
    """One layer's view of the KvccCache: transformers asks layers for lengths and mask sizes."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: "KvccCache", layer_idx: int):
        super().__init__()
        self._owner = owner
        self.layer_idx = layer_idx
        self.length = 0  # tokens this layer has been given (the runtime's length grows at layer 0)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True
        self.dtype, self.device = key_states.dtype, key_states.device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._owner._layer_update(self, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # transformers 5.17's name for get_max_length
        return -1

    def offload(self):  # the pool lives where the runtime put it
        pass

    def prefetch(self):
        pass

    def reset(self) -> None:
        self.length = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise RuntimeError("internal: KvccCache reorders whole rows, not layers")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the kvcc cache cannot drop tokens (crop): pages are written once; "
                                  "assisted / speculative decoding is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise RuntimeError("internal: KvccCache repeats whole rows, not layers")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise RuntimeError("internal: KvccCache selects whole rows, not layers")


class KvccCache(Cache):
    """A transformers Cache whose K/V live in a kvcc.Runtime's INT2 paged cache.

    artifact: a path or kvcc.ArtifactInfo; config: the model's config (or the model). The runtime
    is made at the first forward step, on the device of the model's tensors, with
    max_sequences (default 2 x the batch: room for beam-search forks; each holds a window slot)
    and pages for max_batch_size rows
    of max_tokens tokens each (defaults: the first step's batch, and min(max_position_embeddings,
    8192)). Running out raises kvcc.CacheFull naming both. rows: the runtime sequence of each
    batch row; runtime: the kvcc.Runtime (None before the first step).
    """

    def __init__(self, artifact: str | os.PathLike | ArtifactInfo, config: Any, *, max_batch_size: int | None = None,
                 max_tokens: int | None = None, max_sequences: int | None = None, max_step_tokens: int | None = None):
        config = getattr(config, "config", config)  # a model is accepted too
        self.info = _as_info(artifact)
        self.shape = model_shape(config)
        check_artifact_for_model(self.info, self.shape)
        for name, value in (("max_batch_size", max_batch_size), ("max_tokens", max_tokens),
                            ("max_sequences", max_sequences), ("max_step_tokens", max_step_tokens)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if max_tokens is None:
            cap = self.shape.max_position or DEFAULT_MAX_TOKENS
            max_tokens = min(cap, DEFAULT_MAX_TOKENS)
        self._max_tokens = max_tokens
        self._max_batch = max_batch_size
        self._max_sequences = max_sequences
        self._max_step_tokens = max_step_tokens
        super().__init__(layers=[_KvccLayer(self, i) for i in range(self.shape.n_layers)])
        self.runtime = None
        self.rows: list[int] = []
        self._step_tokens = 0  # T of the open step (0: none open)
        self._appended = 0  # layers whose attention ran in the open step
        self._driven = False  # the open step was opened by a DecodeGraph, which keeps the lengths

    @classmethod
    def for_model(cls, model: Any, artifact: str | os.PathLike | ArtifactInfo, **kwargs) -> "KvccCache":
        """A cache for `model` (loaded with attn_implementation="kvcc"); kwargs as the constructor's."""
        impl = getattr(model.config, "_attn_implementation", None)
        if impl != ATTN_IMPLEMENTATION:
            raise KvccError(f"the model's attention implementation is {impl!r}: load it with "
                            f"attn_implementation=\"{ATTN_IMPLEMENTATION}\" (after `import kvcc.hf`) or use "
                            "kvcc.hf.from_pretrained, so that its attention reads this cache")
        return cls(artifact, model.config, **kwargs)

    # --- what transformers calls -------------------------------------------------------------

    def _layer_update(self, layer: _KvccLayer, key_states: torch.Tensor, value_states: torch.Tensor):
        if key_states.dim() != 4 or key_states.shape != value_states.shape:
            raise KvccError(f"kvcc cache: keys {tuple(key_states.shape)} and values {tuple(value_states.shape)} must "
                            "both be [batch, kv_heads, tokens, head_dim]")
        B, n_kv, T, d = key_states.shape
        if n_kv != self.shape.n_kv_heads or d != self.shape.head_dim:
            raise KvccError(f"kvcc cache: keys of {n_kv} heads x {d} channels, the artifact serves "
                            f"{self.shape.n_kv_heads} x {self.shape.head_dim}")
        if layer.layer_idx == 0 and not self._driven:
            self._begin_step(B, T, key_states.device, key_states.dtype)
        elif T != self._step_tokens or B != len(self.rows):
            raise KvccError(f"kvcc cache: layer {layer.layer_idx} got {B} rows x {T} tokens in a step opened with "
                            f"{len(self.rows)} x {self._step_tokens}")
        if not self._driven:
            layer.length += T
        # The attention function finds this cache and layer through the key tensor it is given.
        key_states._kvcc_step = (self, layer.layer_idx)
        return key_states, value_states

    def _begin_step(self, B: int, T: int, device: torch.device, dtype: torch.dtype) -> None:
        if self._step_tokens and self._appended != self.shape.n_layers:
            raise KvccError(f"kvcc cache: a new step began after {self._appended} of {self.shape.n_layers} layers "
                            "attended in the last one")
        if self.runtime is None:
            self._make_runtime(B, device, dtype)
        if B != len(self.rows):
            raise KvccError(f"kvcc cache: a step of {B} rows on a cache of {len(self.rows)} rows (the batch changed)")
        length = self.layers[0].length
        window = self.shape.sliding_window
        if window is not None and length + T > window:
            raise KvccError(f"kvcc cache: the model attends over a sliding window of {window} tokens and the kvcc "
                            f"runtime attends over the whole context: {length + T} tokens exceed the window")
        sizing = (f"kvcc cache sized for {self._pool_rows} rows of {self._max_tokens} tokens, {length + T} tokens "
                  "needed: pass a larger max_tokens / max_batch_size")
        if length + T > self._max_tokens:
            raise CacheFull(f"a step to {length + T} tokens a row ({sizing})")
        if B * T > self.runtime.max_step_tokens:
            raise KvccError(f"kvcc cache: a step of {B} rows x {T} tokens, above the cache's max_step_tokens "
                            f"{self.runtime.max_step_tokens} (new tokens of one forward, all rows together: pass a "
                            "larger max_step_tokens, or prefill the prompt in shorter blocks)")
        try:
            self.runtime.begin_append(self.rows, [T] * B)
        except CacheFull as e:
            raise CacheFull(f"{e} ({sizing})") from e
        self._step_tokens, self._appended = T, 0

    def _make_runtime(self, B: int, device: torch.device, dtype: torch.dtype) -> None:
        from .runtime import Runtime

        # The kernels take a bfloat16 model's activations as they are; any other dtype through float32.
        act = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        rows = self._max_batch or B
        if B > rows:
            raise KvccError(f"kvcc cache: a batch of {B} rows on a cache made for max_batch_size={rows}")
        self._pool_rows = rows
        s = self.shape
        # The maxima are declared (a step of at most `rows` rows and max_step_tokens new tokens, rows of
        # at most max_tokens): the runtime sizes its step tables once, so a decode step can be
        # captured in a CUDA graph (DecodeGraph). Default step bound: a whole prompt of one row, or
        # 4096 tokens of every row.
        step = self._max_step_tokens or max(rows * min(self._max_tokens, 4096), self._max_tokens)
        self.runtime = Runtime(self.info.path, n_layers=s.n_layers, n_heads=s.n_heads, n_kv_heads=s.n_kv_heads,
                               head_dim=s.head_dim, max_pages=max(1, rows * pages_for_tokens(self.info, self._max_tokens)),
                               max_sequences=self._max_sequences or 2 * rows, device=device, dtype=act,
                               max_batch=rows, max_context=self._max_tokens,
                               max_step_tokens=min(step, rows * self._max_tokens))
        self.rows = [self.runtime.add_sequence() for _ in range(B)]

    def _attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """q [B, H, T, d], k / v [B, n_kv, T, d] (post-RoPE, unrotated) -> out [B, T, H, d]."""
        rt = self.runtime
        B, H, T, d = query.shape
        if H != self.shape.n_heads:
            raise KvccError(f"kvcc attention: {H} query heads, the artifact serves {self.shape.n_heads}")
        # Rows of the step in sequence order, as the runtime's append takes them: [B·T, n_kv, d].
        k_rows = key.transpose(1, 2).reshape(B * T, key.shape[1], d)
        v_rows = value.transpose(1, 2).reshape(B * T, value.shape[1], d)
        # This cache runs eagerly (it is not compileable), so it calls what the custom ops run
        # directly: the ops' dispatch costs ~13 us per call (measured, CPU), ~1 ms per decode step
        # of a 32-layer model. The public calls serve when those are absent.
        append = getattr(rt, "_append_impl", rt.append)
        if T == 1:
            append(layer_idx, k_rows, v_rows)
            decode = getattr(rt, "_decode_impl", rt.decode)
            out = decode(layer_idx, self.rows, query[:, :, 0, :].contiguous()).unsqueeze(1)
        else:
            # Every row's block in one ragged prefill (one set of launches for the batch).
            q_rows = query.transpose(1, 2).reshape(B * T, H, d).contiguous()
            k_rows, v_rows = k_rows.contiguous(), v_rows.contiguous()
            if hasattr(rt, "_prefill_impl"):
                out = rt._prefill_impl(layer_idx, self.rows, [T] * B, q_rows, k_rows, v_rows)
            else:
                out = rt.prefill(layer_idx, self.rows, q_rows, k_rows, v_rows, counts=[T] * B)
            out = out.view(B, T, H, d)
            append(layer_idx, k_rows, v_rows)
        self._appended += 1
        return out

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length if layer_idx < len(self.layers) else 0

    @property
    def batch_size(self) -> int:
        return len(self.rows) if self.runtime is not None else -1

    @property
    def is_compileable(self) -> bool:
        return False

    def _replace_rows(self, sources: list[int]) -> None:
        """New rows forked from rows[sources[i]] (pages shared, windows copied); the old rows freed."""
        if self.runtime is None:
            return
        if self._step_tokens and self._appended != self.shape.n_layers:
            raise KvccError("kvcc cache: rows cannot be reordered in the middle of a forward step")
        rt = self.runtime
        new: list[int] = []
        try:
            for i in sources:
                new.append(rt.fork(self.rows[i]))
        except CacheFull as e:
            for seq in new:  # leave the cache as it was
                rt.free(seq)
            raise CacheFull(f"{e} (reordering {len(self.rows)} rows into {len(sources)} needs sequence slots for "
                            "both: pass a larger max_batch_size)") from e
        for seq in self.rows:
            rt.free(seq)
        self.rows = new

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._replace_rows([int(i) for i in beam_idx.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._replace_rows([i for i in range(len(self.rows)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._replace_rows([int(i) for i in torch.as_tensor(indices).tolist()])

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0 and self.runtime is None:
            return
        self.layers[0].crop(tokens_to_remove)

    def reset(self) -> None:
        """Frees every row; the next step starts empty sequences (the pool is kept)."""
        if self.runtime is not None:
            for seq in self.rows:
                self.runtime.free(seq)
            self.rows = []
            self.runtime.close()
            self.runtime = None
        for layer in self.layers:
            layer.reset()
        self._step_tokens = self._appended = 0

    def bytes_in_use(self) -> int:
        """Bytes of the runtime pool in use (pages + window slots), 0 before the first step."""
        return self.runtime.bytes_in_use() if self.runtime is not None else 0

    # --- a decode step driven by a DecodeGraph ---------------------------------------------------

    def open_graph_step(self) -> None:
        """Opens a decode step of one token a row for a DecodeGraph (outside the graph): the runtime
        plans it and uploads its tables to the fixed addresses the graph's kernels read."""
        if self.runtime is None or not self.rows:
            raise KvccError("kvcc DecodeGraph: the cache is empty: prefill the prompt first (an eager forward)")
        self._begin_step(len(self.rows), 1, self.runtime.device, self.runtime.dtype)
        self._driven = True

    def close_graph_step(self) -> None:
        """Closes the step a DecodeGraph ran: every layer one token longer."""
        self._driven = False
        self._appended = self.shape.n_layers
        for layer in self.layers:
            layer.length += 1


def kvcc_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """The "kvcc" attention implementation: the runtime's prefill / decode over the KvccCache."""
    step = getattr(key, "_kvcc_step", None)
    if step is None:
        raise KvccError("attn_implementation=\"kvcc\" attends through a kvcc.hf.KvccCache, and this forward has "
                        "none: pass one (kvcc.hf.cache_kwargs(model, KvccCache.for_model(model, ARTIFACT))) or load "
                        "the model with kvcc.hf.from_pretrained(..., artifact=...), whose generate makes it")
    cache, layer_idx = step
    d = query.shape[-1]
    if scaling is not None and abs(scaling * math.sqrt(d) - 1.0) > 1e-6:
        raise KvccError(f"kvcc attention: the model scales logits by {scaling}, the runtime by 1/sqrt({d})")
    if dropout:
        raise KvccError("kvcc attention is for inference: attention dropout must be 0 (model.eval())")
    return cache._attend(layer_idx, query, key, value), None


def _kvcc_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> None:
    """The mask function transformers calls for "kvcc": the runtime masks causally by itself, so no
    mask is built; a padding mask with zeros is refused (the runtime has no per-row mask)."""
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise KvccError("kvcc cache: the batch is padded (the attention mask has zeros); the kvcc runtime serves "
                        "rows of equal length only: generate one prompt at a time, or prompts of equal length")
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, kvcc_attention_forward)
if AttentionMaskInterface is not None:
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _kvcc_mask)


def cache_kwargs(model: Any, cache: Cache) -> dict[str, Cache]:
    """{name: cache} for model(...) / model.generate(...): transformers 5.24 calls the argument
    `cache`, 5.17 `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


class DecodeGraph:
    """Decode steps of a model replayed from one CUDA graph: the whole forward of one new token a
    row (projections, RoPE, every layer's append + decode, MLPs, the last position's logits) is one
    graph launch, so the host no longer paces the GPU.

        cache = kvcc.hf.KvccCache.for_model(model, artifact, max_tokens=prompt_len + new_tokens)
        logits = model(prompt, **kvcc.hf.cache_kwargs(model, cache)).logits[:, -1]   # prefill, eager
        step = kvcc.hf.DecodeGraph(model, cache)
        for _ in range(new_tokens):
            logits = step(logits.argmax(-1, keepdim=True))   # [batch, vocab]

    Each call opens the step outside the graph (cache.open_graph_step(): for a KvccCache the
    runtime's begin_append, which plans the step on the host and uploads its tables to fixed device
    addresses), then runs the forward: eagerly at the first call (it warms up what libraries make
    lazily), captured at the second and replayed from then on. The graph reads what it was captured
    with: the batch is fixed, the cache's runtime must have declared maxima (a KvccCache always
    does), and the step's tokens sit at position cache.get_seq_length() of every row (rows of equal
    length, as KvccCache serves). ids: [batch, 1] token ids; the logits returned are a new tensor.
    Everything runs on the object's own stream, ordered after and before the caller's. Eager
    forwards of the same cache may come between calls. A cache class other than KvccCache serves
    too if it has open_graph_step(), close_graph_step() and graph_kwargs() (extra forward
    arguments, e.g. a static attention mask). CUDA only: on the CPU, step the model eagerly.
    """

    def __init__(self, model: Any, cache: Cache):
        device = next(model.parameters()).device
        if device.type != "cuda":
            raise KvccError(f"kvcc DecodeGraph captures CUDA graphs and the model is on {device}: step the model "
                            "eagerly there (model(ids, **kvcc.hf.cache_kwargs(model, cache)))")
        for name in ("open_graph_step", "close_graph_step"):
            if not callable(getattr(cache, name, None)):
                raise KvccError(f"kvcc DecodeGraph: a {type(cache).__name__} cannot be stepped by a graph (it has no "
                                f"{name}()): use a kvcc.hf.KvccCache")
        self.model, self.cache, self.device = model, cache, device
        self.stream = torch.cuda.Stream(device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.steps = 0  # calls so far (the first ran eagerly)
        self._ids = self._positions = self._logits = None

    def _forward(self) -> torch.Tensor:
        extra = self.cache.graph_kwargs() if callable(getattr(self.cache, "graph_kwargs", None)) else {}
        out = self.model(self._ids, position_ids=self._positions, use_cache=True, logits_to_keep=1,
                         **extra, **cache_kwargs(self.model, self.cache))
        return out.logits[:, -1]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != 1:
            raise KvccError(f"kvcc DecodeGraph: ids must be a [batch, 1] tensor of token ids, got "
                            f"{tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__}")
        if self._ids is not None and ids.shape != self._ids.shape:
            raise KvccError(f"kvcc DecodeGraph: a step of {ids.shape[0]} rows on a graph of {self._ids.shape[0]} rows "
                            "(the batch of a graph is fixed: make a new DecodeGraph)")
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        with torch.no_grad(), torch.cuda.stream(self.stream):
            length = self.cache.get_seq_length()
            self.cache.open_graph_step()
            try:
                if self._ids is None:  # what the graph reads its inputs from
                    self._ids = torch.zeros(ids.shape, dtype=torch.long, device=self.device)
                    self._positions = torch.zeros_like(self._ids)
                self._ids.copy_(ids)
                self._positions.fill_(length)
                if self.steps == 0:
                    logits = self._forward()
                else:
                    if self.graph is None:
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, stream=self.stream):
                            self._logits = self._forward()
                        self.graph = graph
                    self.graph.replay()
                    logits = self._logits
                out = logits.clone()
            finally:
                # The rows grew when the step opened, so the step closes even if the forward raised
                # (a failed capture ran nothing: that token's K/V are then unwritten, and what the
                # cache holds from there on is undefined; reset it).
                self.cache.close_graph_step()
        caller.wait_stream(self.stream)
        out.record_stream(caller)
        self.steps += 1
        return out


def from_pretrained(model_dir: str | os.PathLike, artifact: str | os.PathLike | ArtifactInfo | None = None, *,
                    device: str | torch.device = "cpu", dtype: torch.dtype | None = None, **kwargs: Any):
    """Loads a causal LM from model_dir; with an artifact, its attention runs through the kvcc cache.

    artifact: a path, a kvcc.ArtifactInfo, or "zoo" / "zoo:METHOD": the zoo's artifact for this
    model directory (kvcc.zoo.find by fingerprint; oscar unless METHOD says otherwise). The
    artifact is checked against the model's shape (layers, KV heads, head_dim, query heads)
    here. The returned model's generate() makes a KvccCache for each call that passes none (pages
    for the batch x (prompt + max_new_tokens)); model.kvcc_artifact is the ArtifactInfo. Without an
    artifact the model uses SDPA over transformers' own cache. dtype: default float32 on the CPU,
    bfloat16 on CUDA.
    """
    from transformers import AutoModelForCausalLM

    path = os.fspath(model_dir)
    if not os.path.isdir(path):
        raise KvccError(f"no such model directory: {path}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise KvccError(f"{path} is not a Hugging Face model directory (no config.json)")
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(artifact, str) and (artifact == "zoo" or artifact.startswith("zoo:")):
        artifact = zoo_artifact(path, artifact[4:] if artifact.startswith("zoo:") else None)
    info = _as_info(artifact) if artifact is not None else None
    if info is not None:
        from transformers import AutoConfig

        check_artifact_for_model(info, model_shape(AutoConfig.from_pretrained(path)))
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=ATTN_IMPLEMENTATION if info else "sdpa",
                                                 dtype=dtype, **kwargs)
    model.to(device).eval()
    model.kvcc_artifact = info
    if info is not None:
        _attach_generate(model, info)
    return model


def zoo_artifact(model_dir: str | os.PathLike, method: str | None = None, zoo: str | os.PathLike | None = None) -> str:
    """The zoo's artifact for a model directory (matched by fingerprint; method default oscar)."""
    from . import zoo as kzoo

    method = method or "oscar"
    hits = kzoo.find(os.fspath(model_dir), method=method, zoo=zoo)
    if not hits:
        raise KvccError(f"the zoo ({zoo or kzoo.default_zoo()}) has no {method} artifact for {model_dir} (matched by "
                        "the model's fingerprint): compile one, or pass its path")
    return hits[0].artifact_path


def _attach_generate(model: Any, info: ArtifactInfo) -> None:
    original = model.generate
    name = next(iter(cache_kwargs(model, None)))

    def generate(*args, **kwargs):
        if kwargs.get("cache") is None and kwargs.get("past_key_values") is None:
            ids = args[0] if args else kwargs.get("input_ids")
            if ids is None:
                raise KvccError("kvcc generate needs input_ids (to size the cache)")
            gc = kwargs.get("generation_config") or model.generation_config
            new = kwargs.get("max_new_tokens") or getattr(gc, "max_new_tokens", None)
            total = ids.shape[1] + new if new else (kwargs.get("max_length") or getattr(gc, "max_length", None) or 0)
            rows = ids.shape[0] * max(int(kwargs.get("num_return_sequences") or 1), int(kwargs.get("num_beams") or 1))
            kwargs[name] = KvccCache(info, model.config, max_batch_size=rows, max_tokens=max(int(total), 1))
        return original(*args, **kwargs)

    generate.__doc__ = original.__doc__
    model.generate = generate
