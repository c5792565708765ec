"""python -m kvcc.bench_generate: end-to-end generation with the INT2 cache against BF16, one process.

Two models run through transformers (the same engine for both caches):
  * gutenberg-27m (a real model; --gutenberg DIR with its artifact --gutenberg-artifact FILE);
  * an 8B-shaped Llama (Llama-3.1-8B's config: 32 layers, hidden 4096, 32 query / 8 KV heads,
    head_dim 128, intermediate 14336, vocab 128256) with random BF16 weights built on the device,
    served with --artifact-8b FILE (see --make-artifact-8b for how to produce one).
Caches: "int2" = kvcc.hf.KvccCache (the runtime's paged INT2 cache, CUDA kernels), each decode step
an eager forward; "int2-graph" = the same cache, each decode step one replay of a CUDA graph of the
whole forward (kvcc.hf.DecodeGraph; its first two steps, eager and capture, are not timed);
"bf16-graph" = what a CUDA-graph engine does for BF16: a cache preallocated token-major for the run,
the used lengths on the device and FlashAttention's varlen kernel (seqused_k) reading only them,
each decode step replayed from a graph by the same DecodeGraph; "bf16" =
transformers SDPA over a BF16 cache (--bf16-cache: "prealloc", a cache preallocated for the whole
run whose layers hand SDPA views of the filled length, so decode reads the cache once without a
mask; or "dynamic", transformers' DynamicCache, which copies each layer's cache at every step);
with --caches ...,hqq2 also "hqq2" = transformers' own 2-bit cache (QuantizedCache, HQQ backend:
2 bits, groups of 64, the last 128 tokens in BF16; it dequantizes each layer's whole cache for
SDPA at every step; needs the hqq package). No largest-batch search for it (no memory model).

Per model, context L and cache: time to first token (a real prefill of L tokens, where asked),
time per output token over greedy decode steps, tokens/s (batch / TPOT), peak GPU memory (torch's
max_memory_allocated plus the kvcc pool, which the runtime allocates itself; and the device's
used memory from cudaMemGetInfo), and the largest batch that fits: computed from the memory model
(bytes per sequence of the cache; free memory after the weights minus --reserve-gib), then verified
by allocating that batch and decoding through the real model (one row fewer on failure, down to
the first that runs). Long contexts are filled the cheap way: each row's first --prefix tokens are
a real prefill through the model (its own K/V), the rest synthetic K/V (normal, unit variance)
appended to the cache directly; decode then runs the real model over the whole cache. The output
says which rows were so filled ("fill": "prefix+synthetic").

Every decode row also gives the bytes a step must read at least (the weights, and every row's cache
as it stands: BF16 K/V, or the kvcc pool's pages and window slots in use) over its TPOT, the
bandwidth the step achieved: how far each cache is from the copy ceiling (~4 TB/s on an H200), i.e.
what any faster engine (CUDA graphs included) could still gain.

Writes --json (every measurement) and --markdown (tables and the goals: at 100K on the 8B shape
>= 6.5x the BF16 batch and >= 6x its decode throughput at each cache's largest batch; TPOT at
batch 1 / 32K no worse than BF16). Each side is its better mode (bf16 / bf16-graph, int2 /
int2-graph), named; the goals are also given eager against eager and graph against graph.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

EPILOG = """\
examples:
  # the whole run on an H200 (about 8-12 minutes: four caches)
  python -m kvcc.bench_generate --gutenberg ../shared/models/gutenberg-27m \\
      --gutenberg-artifact zoo/published/gutenberg-27m/oscar-int2-g128-p2/artifact.c50773be60ee.kvcc.h5 \\
      --artifact-8b llama8b.hadamard.kvcc.h5 --json gen.json --markdown gen.md
  # an artifact for the 8B shape (needs the kvcc CLI; ~1-2 minutes of CPU): a narrow random model
  # with Llama-3.1-8B's attention shape is calibrated on random tokens and compiled with hadamard
  python -m kvcc.bench_generate --make-artifact-8b llama8b.hadamard.kvcc.h5 --kvcc-cli build/cli/kvcc
  # shrink: one context, fewer steps, no capacity search
  python -m kvcc.bench_generate --artifact-8b A.kvcc.h5 --models 8b --contexts 32K --decode-steps 8 --no-capacity
  # CPU smoke run (tiny, the CPU reference kernels): the real model only
  python -m kvcc.bench_generate --device cpu --models gutenberg --gutenberg DIR --gutenberg-artifact A \\
      --gutenberg-context 300 --decode-steps 2 --batches 1,2 --no-capacity --json smoke.json
"""

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
GIB = 1 << 30


def _tokens(text: str) -> int:
    t = text.strip().upper()
    mult = 1
    if t.endswith("K"):
        t, mult = t[:-1], 1024
    n = int(float(t) * mult) if mult > 1 else int(t)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"a context must be positive, got {text}")
    return n


def _int_list(text: str) -> list[int]:
    out = [int(x) for x in text.split(",") if x.strip()]
    if not out or any(x <= 0 for x in out):
        raise argparse.ArgumentTypeError(f"a comma-separated list of positive integers, got {text!r}")
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvcc.bench_generate", description=__doc__.split("\n\n")[0],
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gutenberg,8b", help="comma list of gutenberg, 8b (default both)")
    p.add_argument("--caches", help="comma list of bf16, bf16-graph, int2, int2-graph, hqq2 (default "
                   "bf16,bf16-graph,int2,int2-graph; bf16,int2 with --device cpu; *-graph: decode steps replayed "
                   "from a CUDA graph; hqq2: transformers' QuantizedCache with the HQQ backend at 2 bits)")
    p.add_argument("--gutenberg", metavar="DIR", help="gutenberg-27m model directory")
    p.add_argument("--gutenberg-artifact", metavar="FILE", help="its kvcc artifact")
    p.add_argument("--gutenberg-context", type=_tokens, default=1920, help="prompt tokens for gutenberg-27m "
                   "(real prefill; default 1920, its window is 2048)")
    p.add_argument("--artifact-8b", metavar="FILE", help="kvcc artifact with the 8B shape (32/32/8/128)")
    p.add_argument("--contexts", default="8K,32K,100K", help="8B contexts (default 8K,32K,100K; K = 1024, "
                   "100K = 102400)")
    p.add_argument("--ttft-contexts", default="8K,32K", help="8B contexts whose batch-1 run prefills the whole "
                   "context through the model (TTFT); others fill a prefix + synthetic K/V (default 8K,32K; '' for "
                   "none)")
    p.add_argument("--batches", type=_int_list, default=[1], help="batch sizes measured at every context besides "
                   "the largest (default 1)")
    p.add_argument("--decode-steps", type=int, default=16, help="greedy decode steps timed (default 16; the first "
                   "is a warm-up and not counted)")
    p.add_argument("--prefix", type=int, default=64, help="real tokens per row before synthetic K/V (default 64)")
    p.add_argument("--no-capacity", action="store_true", help="skip the largest-batch search and runs")
    p.add_argument("--max-batch", type=int, default=1024, help="cap on the largest batch (default 1024)")
    p.add_argument("--reserve-gib", type=float, default=6.0, help="memory kept free for activations and "
                   "workspaces when computing the largest batch (default 6 GiB)")
    p.add_argument("--bf16-cache", choices=["prealloc", "dynamic"], default="prealloc")
    p.add_argument("--allow-cudnn-sdpa", action="store_true",
                   help="let SDPA pick its cuDNN backend for the BF16 cache (off by default: cuDNN builds an "
                        "execution plan per new KV length, ~50 ms per decode step of every new length, which "
                        "no serving engine pays; flash / memory-efficient attention are used instead)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--narrow-8b", action="store_true", help="smoke runs only: the 8B attention shape with hidden "
                   "256, intermediate 256, vocab 256 (what --make-artifact-8b calibrates), not the 8B model")
    p.add_argument("--json", metavar="FILE", help="write all measurements as JSON")
    p.add_argument("--markdown", metavar="FILE", help="write the tables as markdown")
    p.add_argument("--make-artifact-8b", metavar="OUT", help="only produce an 8B-shape artifact at OUT and exit")
    p.add_argument("--method-8b", default="hadamard", choices=["hadamard", "identity", "oscar"],
                   help="compile method for --make-artifact-8b (default hadamard: the runtime's rotation cost)")
    p.add_argument("--layers-8b", type=int, default=32, help="layers of the --make-artifact-8b model (default 32, "
                   "the 8B model's; bench/bench_step_torch.py takes a 4-layer one)")
    p.add_argument("--kvcc-cli", default=os.environ.get("KVCC_CLI", "build/cli/kvcc"),
                   help="the kvcc executable for --make-artifact-8b")
    return p


# --- an artifact for the 8B shape ---------------------------------------------------------------------


def make_artifact_8b(out: str, cli: str, method: str = "hadamard", layers: int = 32) -> None:
    """Calibrates a narrow random Llama with Llama-3.1-8B's attention shape (32 layers, 32 / 8 heads,
    head_dim 128; hidden 256) on random token ids and compiles `method` at 2 bits. The runtime
    checks only layers, heads and head_dim, so the artifact serves the full 8B shape; its clip
    ratios come from a random model, which is what the benchmark's random weights are too."""
    import random

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if not (os.path.isfile(cli) and os.access(cli, os.X_OK)):
        raise SystemExit(f"--kvcc-cli {cli}: not an executable (build the CLI, or pass its path)")
    if layers < 1:
        raise SystemExit(f"--layers-8b must be >= 1, got {layers}")
    cfg = dict(LLAMA_8B, hidden_size=256, intermediate_size=256, vocab_size=256, tie_word_embeddings=True,
               num_hidden_layers=layers)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16).save_pretrained(os.path.join(tmp, "model"))
        rng = random.Random(0)
        ids = os.path.join(tmp, "calib.ids")
        with open(ids, "w") as f:
            for _ in range(4):
                f.write(" ".join(str(rng.randrange(256)) for _ in range(512)) + "\n")
        stats = os.path.join(tmp, "stats.h5")
        subprocess.run([cli, "calibrate-model", "--model", os.path.join(tmp, "model"), "--ids", ids, "--tokens",
                        "2048", "-o", stats], check=True)
        subprocess.run([cli, "compile", stats, "--model-id", "llama-3.1-8b-shape-random", "-m", method,
                        "--key-bits", "2", "--value-bits", "2", "-o", out], check=True)
    print(f"wrote {out}")


# --- caches ---------------------------------------------------------------------------------------------


def _bf16_cache_classes():
    import torch
    from transformers.cache_utils import Cache, DynamicLayer

    class PreallocLayer(DynamicLayer):
        """A BF16 layer cache preallocated for the whole run; SDPA gets views of the filled part."""

        def __init__(self, batch: int, n_kv: int, capacity: int, head_dim: int, dtype, device):
            super().__init__()
            self.buf_k = torch.empty(batch, n_kv, capacity, head_dim, dtype=dtype, device=device)
            self.buf_v = torch.empty_like(self.buf_k)
            self.n = 0
            self.dtype, self.device = dtype, device
            self.is_initialized = True

        def lazy_initialization(self, key_states, value_states):
            pass

        def update(self, key_states, value_states, *args, **kwargs):
            T = key_states.shape[2]
            if self.n + T > self.buf_k.shape[2]:
                raise RuntimeError(f"prealloc cache full: {self.n} + {T} > {self.buf_k.shape[2]}")
            self.buf_k[:, :, self.n:self.n + T].copy_(key_states)
            self.buf_v[:, :, self.n:self.n + T].copy_(value_states)
            self.n += T
            self.keys, self.values = self.buf_k[:, :, :self.n], self.buf_v[:, :, :self.n]
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.n

        def get_mask_sizes(self, query_length: int):
            return self.n + query_length, 0

    class PreallocCache(Cache):
        def __init__(self, n_layers, batch, n_kv, capacity, head_dim, dtype, device):
            super().__init__(layers=[PreallocLayer(batch, n_kv, capacity, head_dim, dtype, device)
                                     for _ in range(n_layers)])

    return PreallocLayer, PreallocCache


INT2_CACHES = ("int2", "int2-graph")  # the kvcc cache, stepped eagerly or from a graph
STATIC_ATTENTION = "kvcc_bench_bf16_static"
_static_classes = None


def _static_bf16_classes():
    """The BF16 cache of "bf16-graph": what a CUDA-graph engine does for BF16 (vLLM / SGLang with
    FlashAttention): K/V preallocated for the whole run, token-major [batch, capacity, kv_heads,
    head_dim], each row's used length in a device tensor, and attention by FlashAttention's varlen
    kernel (torch.ops.aten._flash_attention_forward with seqused_k), which reads only the used
    part: so a decode step has fixed shapes and is captured by kvcc.hf.DecodeGraph."""
    global _static_classes
    if _static_classes is not None:
        return _static_classes
    import torch
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.masking_utils import AttentionMaskInterface

    if "seqused_k" not in str(torch.ops.aten._flash_attention_forward.default._schema):
        raise RuntimeError(f"torch {torch.__version__}'s FlashAttention op has no seqused_k: no bf16-graph cache")

    class StaticLayer(CacheLayerMixin):
        is_sliding = False
        is_compileable = False

        def __init__(self, owner, batch, n_kv, capacity, head_dim, dtype, device):
            super().__init__()
            self.owner = owner
            self.buf_k = torch.empty(batch, capacity, n_kv, head_dim, dtype=dtype, device=device)
            self.buf_v = torch.empty_like(self.buf_k)
            self.buf_k._static_owner = owner  # the attention function finds the lengths through it
            self.n = 0
            self.dtype, self.device = dtype, device
            self.is_initialized = True

        def lazy_initialization(self, key_states, value_states):
            pass

        def update(self, key_states, value_states, *args, **kwargs):
            T = key_states.shape[2]
            k, v = key_states.transpose(1, 2), value_states.transpose(1, 2)
            if self.owner.graph_pos is not None:  # a graph step: the write position is on the device
                self.buf_k.index_copy_(1, self.owner.graph_pos, k)
                self.buf_v.index_copy_(1, self.owner.graph_pos, v)
            else:
                if self.n + T > self.buf_k.shape[1]:
                    raise RuntimeError(f"static cache full: {self.n} + {T} > {self.buf_k.shape[1]}")
                self.buf_k[:, self.n:self.n + T].copy_(k)
                self.buf_v[:, self.n:self.n + T].copy_(v)
                self.n += T
                if self is self.owner.layers[0]:
                    self.owner.used.fill_(self.n)
            return self.buf_k, self.buf_v

        def get_seq_length(self) -> int:
            return self.n

        def get_mask_sizes(self, query_length: int):
            return self.n + query_length, 0

        def get_max_length(self) -> int:
            return self.buf_k.shape[1]

        def get_max_cache_shape(self) -> int:
            return self.buf_k.shape[1]

    class StaticCache(Cache):
        def __init__(self, n_layers, batch, n_kv, capacity, head_dim, dtype, device):
            super().__init__(layers=[StaticLayer(self, batch, n_kv, capacity, head_dim, dtype, device)
                                     for _ in range(n_layers)])
            self.used = torch.zeros(batch, dtype=torch.int32, device=device)  # tokens of each row
            self.cu_k = torch.arange(batch + 1, dtype=torch.int32, device=device) * capacity
            self.cu_q = {1: torch.arange(batch + 1, dtype=torch.int32, device=device)}
            self.graph_pos = None

        def open_graph_step(self):
            n = self.layers[0].n
            if n + 1 > self.layers[0].buf_k.shape[1]:
                raise RuntimeError(f"static cache full at {n} tokens")
            self.graph_pos = torch.full((1,), n, dtype=torch.long, device=self.used.device)
            self.used.fill_(n + 1)

        def close_graph_step(self):
            self.graph_pos = None
            for layer in self.layers:
                layer.n += 1

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        owner = key._static_owner
        B, H, T, D = query.shape
        cap = key.shape[1]
        cu_q = owner.cu_q.get(T)
        if cu_q is None:
            cu_q = owner.cu_q[T] = torch.arange(B + 1, dtype=torch.int32, device=query.device) * T
        q = query.transpose(1, 2).reshape(B * T, H, D)
        out = torch.ops.aten._flash_attention_forward(
            q, key.view(B * cap, key.shape[2], D), value.view(B * cap, key.shape[2], D), cu_q, owner.cu_k, T, cap,
            0.0, T > 1, False, scale=scaling, seqused_k=owner.used)[0]
        return out.view(B, T, H, D), None

    AttentionInterface.register(STATIC_ATTENTION, attention)
    AttentionMaskInterface.register(STATIC_ATTENTION, lambda *a, **k: None)  # causal inside the kernel
    _static_classes = (StaticLayer, StaticCache)
    return _static_classes


def _kvcc_bytes_per_sequence(info, tokens: int) -> tuple[int, int, int]:
    """(page bytes, window-slot bytes, bytes of one sequence of `tokens`) of the runtime's pool,
    as the library lays it out (docs/runtime.md: per layer and KV head a page holds P tokens of
    codes and their (scale, zero) pairs; a slot (sink + recent) x d BF16 keys and values)."""
    from .artifact import pages_for_tokens

    page, slot = int(info.cache["page_bytes"]), int(info.cache["slot_bytes"])
    return page, slot, pages_for_tokens(info, tokens) * page + slot


def _bf16_bytes_per_sequence(shape, tokens: int) -> int:
    return shape.n_layers * shape.n_kv_heads * tokens * shape.head_dim * 2 * 2


# --- one measurement ------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace):
        import torch

        self.args = args
        self.torch = torch
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.results: list[dict[str, Any]] = []

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def clean(self):
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()

    def used_bytes(self) -> int:
        if not self.cuda:
            return 0
        free, total = self.torch.cuda.mem_get_info()
        return total - free

    def _set_attn(self, model, name: str) -> None:
        try:
            model.set_attn_implementation(name)
        except Exception:  # older transformers: the config field is what the layers read
            model.config._attn_implementation = name

    def _make_cache(self, model, kind: str, info, batch: int, capacity: int):
        from . import hf

        shape = hf.model_shape(model.config)
        if kind in INT2_CACHES:
            self._set_attn(model, hf.ATTN_IMPLEMENTATION)
            return hf.KvccCache(info, model.config, max_batch_size=batch, max_tokens=capacity, max_sequences=batch)
        if kind == "bf16-graph":
            _, StaticCache = _static_bf16_classes()
            self._set_attn(model, STATIC_ATTENTION)
            return StaticCache(shape.n_layers, batch, shape.n_kv_heads, capacity, shape.head_dim, model.dtype,
                               self.device)
        self._set_attn(model, "sdpa")
        if kind == "hqq2":
            from transformers.cache_utils import QuantizedCache

            return QuantizedCache(backend="hqq", config=model.config, nbits=2, q_group_size=64, residual_length=128)
        if self.args.bf16_cache == "dynamic":
            from transformers import DynamicCache

            try:
                return DynamicCache(config=model.config)
            except TypeError:
                return DynamicCache()
        _, PreallocCache = _bf16_cache_classes()
        return PreallocCache(shape.n_layers, batch, shape.n_kv_heads, capacity, shape.head_dim, model.dtype,
                             self.device)

    def _forward(self, model, ids, cache):
        from . import hf

        return model(ids, use_cache=True, logits_to_keep=1, **hf.cache_kwargs(model, cache)).logits[:, -1]

    def _fill_synthetic(self, model, kind: str, cache, tokens: int) -> None:
        """Appends `tokens` synthetic K/V rows (normal, unit variance) to every row of the cache."""
        torch = self.torch
        if tokens <= 0:
            return
        from . import hf

        shape = hf.model_shape(model.config)
        gen = torch.Generator(device=self.device).manual_seed(1)
        if kind in INT2_CACHES:
            rt = cache.runtime
            chunk = 8192
            for seq in cache.rows:
                for c0 in range(0, tokens, chunk):
                    c = min(chunk, tokens - c0)
                    rt.begin_append([seq], [c])
                    for layer in range(shape.n_layers):
                        k = torch.randn(c, shape.n_kv_heads, shape.head_dim, generator=gen, device=self.device,
                                        dtype=model.dtype)
                        v = torch.randn(c, shape.n_kv_heads, shape.head_dim, generator=gen, device=self.device,
                                        dtype=model.dtype)
                        rt.append(layer, k, v)
            for layer in cache.layers:
                layer.length += tokens
            return
        if kind == "hqq2":
            # Through the cache's own update: the rows are quantised as generation would.
            B = int(self._batch)
            for layer in cache.layers:
                k = torch.randn(B, shape.n_kv_heads, tokens, shape.head_dim, generator=gen, device=self.device,
                                dtype=model.dtype)
                layer.update(k, torch.randn_like(k))
            return
        if kind == "bf16-graph":
            for layer in cache.layers:
                n = layer.n
                layer.buf_k[:, n:n + tokens].normal_(generator=gen)
                layer.buf_v[:, n:n + tokens].normal_(generator=gen)
                layer.n += tokens
            cache.used.fill_(cache.layers[0].n)
            return
        for layer in cache.layers:
            if self.args.bf16_cache == "prealloc":
                n = layer.n
                layer.buf_k[:, :, n:n + tokens].normal_(generator=gen)
                layer.buf_v[:, :, n:n + tokens].normal_(generator=gen)
                layer.n += tokens
                layer.keys, layer.values = layer.buf_k[:, :, :layer.n], layer.buf_v[:, :, :layer.n]
            else:
                B, H, _, D = layer.keys.shape
                extra = torch.randn(B, H, tokens, D, generator=gen, device=self.device, dtype=layer.keys.dtype)
                layer.keys = torch.cat([layer.keys, extra], dim=2)
                layer.values = torch.cat([layer.values, torch.randn_like(extra)], dim=2)
                if hasattr(layer, "cumulative_length"):
                    layer.cumulative_length += tokens

    def run(self, model, model_name: str, kind: str, info, context: int, batch: int, real_prefill: bool,
            vocab: int) -> dict[str, Any]:
        """One (cache, context, batch) run: prefill, fill, timed decode. Raises on OOM / CacheFull."""
        torch = self.torch
        from . import hf

        warm = _warm_steps(kind)
        steps = max(2, self.args.decode_steps) - 1 + warm
        prefix = context if real_prefill else min(self.args.prefix, context)
        self.clean()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        used0 = self.used_bytes()
        cache = self._make_cache(model, kind, info, batch, context + steps + 1)
        self._batch = batch
        rec: dict[str, Any] = dict(model=model_name, cache=kind, context=context, batch=batch,
                                   fill="prefill" if real_prefill else "prefix+synthetic", prefix_tokens=prefix)
        try:
            gen = torch.Generator(device="cpu").manual_seed(0)
            ids = torch.randint(0, vocab, (batch, prefix), generator=gen).to(self.device)
            with torch.no_grad():
                self.sync()
                t0 = time.perf_counter()
                logits = self._forward(model, ids, cache)
                nxt = logits.argmax(-1, keepdim=True)
                self.sync()
                ttft = time.perf_counter() - t0
                if real_prefill:
                    rec["ttft_s"] = ttft
                self._fill_synthetic(model, kind, cache, context - prefix)
                self.sync()
                if kind.endswith("-graph"):
                    step = hf.DecodeGraph(model, cache)
                else:
                    step = lambda ids: self._forward(model, ids, cache)  # noqa: E731
                times = []
                for _ in range(steps):
                    t0 = time.perf_counter()
                    logits = step(nxt)
                    nxt = logits.argmax(-1, keepdim=True)
                    self.sync()
                    times.append(time.perf_counter() - t0)
            timed = sorted(times[warm:])
            tpot = timed[len(timed) // 2]  # median step
            rec.update(tpot_s=tpot, tpot_mean_s=sum(timed) / len(timed), tokens_per_s=batch / tpot,
                       decode_steps=len(timed), warmup_s=times[:warm], length_after=cache.get_seq_length())
            if self.cuda:
                torch_peak = torch.cuda.max_memory_allocated()
                pool = 0
                if kind in INT2_CACHES:
                    page, slot, _ = _kvcc_bytes_per_sequence(info, 0)
                    pool = cache.runtime.max_pages * page + cache.runtime.max_sequences * slot
                rec.update(peak_torch_bytes=torch_peak, kvcc_pool_bytes=pool, peak_bytes=torch_peak + pool,
                           device_used_bytes=self.used_bytes(), device_used_before_bytes=used0)
            if kind in INT2_CACHES:
                rec["cache_bytes_in_use"] = cache.bytes_in_use()
            elif kind == "hqq2":
                rec["cache_bytes_in_use"] = _tensor_bytes([(la._quantized_keys, la._quantized_values, la.keys, la.values)
                                                           for la in cache.layers])
            else:
                rec["cache_bytes_in_use"] = _bf16_bytes_per_sequence(_shape(model), cache.get_seq_length()) * batch
            weights = sum(p.numel() * p.element_size() for p in model.parameters())
            rec["read_bytes_per_step"] = weights + rec["cache_bytes_in_use"]
            rec["read_bytes_per_s"] = rec["read_bytes_per_step"] / tpot
        finally:
            if kind in INT2_CACHES and cache.runtime is not None:
                cache.runtime.close()
            del cache
            self.clean()
        return rec

    def largest_batch(self, model, model_name, kind, info, context, vocab) -> dict[str, Any]:
        """The memory model's largest batch, verified by running it (one fewer row per failure)."""
        torch = self.torch
        shape = _shape(model)
        capacity = context + max(2, self.args.decode_steps) + _warm_steps(kind)
        per_seq = (_kvcc_bytes_per_sequence(info, capacity)[2] if kind in INT2_CACHES
                   else _bf16_bytes_per_sequence(shape, capacity))
        self.clean()
        free, total = torch.cuda.mem_get_info()
        budget = free - int(self.args.reserve_gib * GIB)
        computed = max(0, min(self.args.max_batch, budget // per_seq))
        b = computed
        tried = []
        while b > 0:
            failed = None
            try:
                rec = self.run(model, model_name, kind, info, context, b, False, vocab)
                rec.update(largest=True, computed_batch=computed, bytes_per_sequence=per_seq, budget_bytes=budget,
                           failed_batches=tried)
                return rec
            except Exception as e:  # OOM or CacheFull: the model said too many
                if not _is_oom(e):
                    raise
                failed = f"{type(e).__name__}: {str(e)[:200]}"
            # Outside the except block, so the traceback's frames (and their tensors) are gone.
            tried.append([b, failed])
            self.clean()
            b -= max(1, b // 32)
        return dict(model=model_name, cache=kind, context=context, largest=True, computed_batch=computed, batch=0,
                    failed_batches=tried)


def _warm_steps(kind: str) -> int:
    """Decode steps run before the timed ones: one (lazy library state), and for a CUDA graph a
    second, its capture."""
    return 2 if kind.endswith("-graph") else 1


def _tensor_bytes(obj) -> int:
    """Bytes of every distinct tensor storage in obj (nested lists, tuples, dicts)."""
    import torch

    seen, total = set(), 0

    def walk(x):
        nonlocal total
        if isinstance(x, torch.Tensor):
            key = x.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += x.untyped_storage().nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(obj)
    return total


def _is_oom(e: Exception) -> bool:
    import torch

    from ._lib import CacheFull

    if isinstance(e, (torch.cuda.OutOfMemoryError, CacheFull)):
        return True
    text = str(e).lower()
    return "out of memory" in text or "cannot allocate" in text or "cudaerrormemoryallocation" in text


def _shape(model):
    from . import hf

    return hf.model_shape(model.config)


# --- models ---------------------------------------------------------------------------------------------


def build_8b(device, narrow: bool = False):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(LLAMA_8B, hidden_size=256, intermediate_size=256, vocab_size=256) if narrow else LLAMA_8B
    cfg = LlamaConfig(**shape)
    torch.manual_seed(0)
    with torch.device(device):
        try:
            model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
        except TypeError:
            model = LlamaForCausalLM._from_config(cfg, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def _fmt_bytes(n) -> str:
    return "" if n is None else f"{n / GIB:.2f} GiB"


def _fmt_s(s, scale=1e3, unit="ms") -> str:
    return "" if s is None else f"{s * scale:.2f} {unit}"


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# kvcc end-to-end generation ({result['device']}, {result['date']})", "",
             f"torch {result['torch']}, transformers {result['transformers']}, kvcc {result['kvcc']}; "
             f"BF16 cache: {result['bf16_cache']} (SDPA's cuDNN backend {'allowed' if result.get('cudnn_sdpa') else 'off'}); "
             f"decode steps timed: {result['decode_steps']} (median).",
             "Rows marked prefix+synthetic: each sequence's first tokens are a real prefill, the rest synthetic "
             "K/V appended to the cache; decode runs the real model over all of it.", "",
             "read/s: the bytes a step reads at least (weights + the cache as it stands) over its TPOT.", "",
             "| model | cache | context | batch | fill | TTFT | TPOT | tokens/s | read/s | peak memory | device used | "
             "largest |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append("| {model} | {cache} | {context} | {batch} | {fill} | {ttft} | {tpot} | {tps} | {bw} | {peak} | "
                     "{used} | {largest} |".format(
                         model=r["model"], cache=r["cache"], context=r["context"], batch=r.get("batch", 0),
                         fill=r.get("fill", ""), ttft=_fmt_s(r.get("ttft_s")), tpot=_fmt_s(r.get("tpot_s")),
                         tps=f"{r['tokens_per_s']:.1f}" if "tokens_per_s" in r else "",
                         bw=f"{r['read_bytes_per_s'] / 1e12:.2f} TB/s" if "read_bytes_per_s" in r else "",
                         peak=_fmt_bytes(r.get("peak_bytes")), used=_fmt_bytes(r.get("device_used_bytes")),
                         largest=(f"yes (computed {r.get('computed_batch', '?')})" if r.get("largest") else "")))
        if r.get("error"):
            err = r["error"].replace("|", "/").replace("\n", " ")
            lines[-1] = (f"| {r['model']} | {r['cache']} | {r['context']} | {r.get('batch', 'largest')} | "
                         f"failed: {err} | | | | | | | |")
    if result.get("goals"):
        lines += ["", "## Goals", "", "Pairing best: each cache in its faster mode (the issue's goals); eager / graph: "
                  "both caches in that mode.", "", "| pairing | goal | measured | target | met |", "|---|---|---|---|---|"]
        for g in result["goals"]:
            lines.append(f"| {g.get('pairing', 'best')} | {g['goal']} | {g['measured']} | {g['target']} | "
                         f"{'yes' if g['met'] else 'no'} |")
    return "\n".join(lines) + "\n"


def goals(runs: list[dict[str, Any]], long_context: int) -> list[dict[str, Any]]:
    """The issue's goals on the 8B shape, each side in its better mode (bf16 / bf16-graph, int2 /
    int2-graph; pairing "best"), then the same goals eager against eager and graph against graph
    where both were measured."""
    def find(cache, context, batch=None, largest=False):
        for r in runs:
            if (r["model"] == "llama-8b-shape" and r["cache"] == cache and r["context"] == context
                    and bool(r.get("largest")) == largest and (batch is None or r.get("batch") == batch)
                    and "tokens_per_s" in r):
                return r
        return None

    def best(caches, key, **where):
        found = [r for r in (find(c, **where) for c in caches) if r]
        return max(found, key=key) if found else None

    pairings = [("best", ("bf16", "bf16-graph"), INT2_CACHES), ("eager", ("bf16",), ("int2",)),
                ("graph", ("bf16-graph",), ("int2-graph",))]
    out = []
    for pairing, bf, i2s in pairings:
        def goal(text, b, i, **kw):
            out.append(dict(goal=f"{text} ({i['cache']} / {b['cache']})", pairing=pairing, **kw))

        where = dict(context=long_context, largest=True)
        b2, i2 = best(bf, lambda r: r["batch"], **where), best(i2s, lambda r: r["batch"], **where)
        if b2 and i2 and b2.get("batch") and pairing == "best":  # a memory property: one line
            ratio = i2["batch"] / b2["batch"]
            goal(f"concurrent sequences at {long_context}", b2, i2,
                 measured=f"{i2['batch']} / {b2['batch']} = {ratio:.2f}x", target=">= 6.5x", met=ratio >= 6.5)
        b2, i2 = best(bf, lambda r: r["tokens_per_s"], **where), best(i2s, lambda r: r["tokens_per_s"], **where)
        if b2 and i2:
            t = i2["tokens_per_s"] / b2["tokens_per_s"]
            goal(f"decode tokens/s at each cache's largest batch, {long_context}, batch {i2['batch']} / "
                 f"{b2['batch']}", b2, i2, measured=f"{i2['tokens_per_s']:.1f} / {b2['tokens_per_s']:.1f} = {t:.2f}x",
                 target=">= 6x", met=t >= 6)
        where = dict(context=32768, batch=1)
        b1, i1 = best(bf, lambda r: -r["tpot_s"], **where), best(i2s, lambda r: -r["tpot_s"], **where)
        if b1 and i1:
            goal("TPOT at batch 1 / 32K", b1, i1, measured=f"{i1['tpot_s'] * 1e3:.2f} ms vs {b1['tpot_s'] * 1e3:.2f} ms",
                 target="INT2 <= BF16", met=i1["tpot_s"] <= b1["tpot_s"])
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.make_artifact_8b:
        make_artifact_8b(args.make_artifact_8b, args.kvcc_cli, args.method_8b, args.layers_8b)
        return 0
    import torch
    import transformers

    import kvcc
    from . import hf
    from ._lib import KvccError

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in ("gutenberg", "8b"):
            raise SystemExit(f"--models: unknown model {m!r} (gutenberg, 8b)")
    if args.caches is None:
        args.caches = "bf16,bf16-graph,int2,int2-graph" if args.device == "cuda" else "bf16,int2"
    caches = [c.strip() for c in args.caches.split(",") if c.strip()]
    for c in caches:
        if c not in ("bf16", "bf16-graph", "int2", "int2-graph", "hqq2"):
            raise SystemExit(f"--caches: unknown cache {c!r} (bf16, bf16-graph, int2, int2-graph, hqq2)")
    graphs = [c for c in caches if c.endswith("-graph")]
    if graphs and args.device != "cuda":
        raise SystemExit(f"--caches {','.join(graphs)} replays CUDA graphs: it needs --device cuda")
    if "hqq2" in caches:
        try:
            import hqq  # noqa: F401
        except ImportError:
            raise SystemExit("--caches hqq2 needs the hqq package (pip install hqq): transformers' QuantizedCache "
                             "uses it as its backend") from None
    if args.decode_steps < 2:
        raise SystemExit("--decode-steps must be >= 2 (the first step is a warm-up)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device (use --device cpu for a smoke run)")
    if args.device == "cuda" and not args.allow_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if args.device == "cpu" and not args.no_capacity:
        raise SystemExit("the largest-batch search measures GPU memory: pass --no-capacity with --device cpu")
    if "gutenberg" in models and not (args.gutenberg and args.gutenberg_artifact):
        raise SystemExit("--models gutenberg needs --gutenberg DIR and --gutenberg-artifact FILE")
    if "8b" in models and not args.artifact_8b:
        raise SystemExit("--models 8b needs --artifact-8b FILE (make one with --make-artifact-8b OUT)")
    try:
        contexts = [_tokens(c) for c in args.contexts.split(",") if c.strip()]
        ttft_contexts = {_tokens(c) for c in args.ttft_contexts.split(",") if c.strip()}
    except (ValueError, argparse.ArgumentTypeError) as e:
        raise SystemExit(f"--contexts / --ttft-contexts: {e}") from None
    if not contexts:
        raise SystemExit("--contexts: give at least one context")
    bench = Bench(args)
    runs: list[dict[str, Any]] = []

    def record(fn, **what):
        """Runs one measurement; a failure is recorded (and printed) instead of ending the run."""
        try:
            rec = fn()
        except KvccError:
            raise
        except Exception as e:  # noqa: BLE001 (one failed run must not lose the others' numbers)
            rec = dict(what, error=f"{type(e).__name__}: {str(e)[:300]}")
            bench.clean()
        runs.append(rec)
        print(json.dumps(rec), flush=True)

    try:
        if "gutenberg" in models:
            # BF16 weights and activations on every device, so the "bf16" cache is BF16 there too.
            model = hf.from_pretrained(args.gutenberg, device=args.device, dtype=torch.bfloat16)
            info = kvcc.load_artifact(args.gutenberg_artifact)
            hf.check_artifact_for_model(info, hf.model_shape(model.config))
            for kind in caches:
                for b in args.batches:
                    record(lambda: bench.run(model, "gutenberg-27m", kind, info, args.gutenberg_context, b, True,
                                             model.config.vocab_size),
                           model="gutenberg-27m", cache=kind, context=args.gutenberg_context, batch=b)
            del model
            bench.clean()
        if "8b" in models:
            info = kvcc.load_artifact(args.artifact_8b)
            t0 = time.perf_counter()
            model = build_8b(bench.device, args.narrow_8b)
            hf.check_artifact_for_model(info, hf.model_shape(model.config))
            bench.sync()
            print(f"8B-shaped model built on {bench.device} in {time.perf_counter() - t0:.1f} s", flush=True)
            weights = sum(p.numel() * p.element_size() for p in model.parameters())
            print(f"weights: {weights / GIB:.2f} GiB", flush=True)
            for context in contexts:
                for kind in caches:
                    for b in args.batches:
                        record(lambda: bench.run(model, "llama-8b-shape", kind, info, context, b,
                                                 b == 1 and context in ttft_contexts, model.config.vocab_size),
                               model="llama-8b-shape", cache=kind, context=context, batch=b)
                    if not args.no_capacity and kind != "hqq2":
                        record(lambda: bench.largest_batch(model, "llama-8b-shape", kind, info, context,
                                                           model.config.vocab_size),
                               model="llama-8b-shape", cache=kind, context=context, largest=True)
    except KvccError as e:
        print(f"python -m kvcc.bench_generate: error: {e}", file=sys.stderr)
        return 1
    result = dict(device=torch.cuda.get_device_name() if bench.cuda else "cpu",
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), torch=torch.__version__,
                  transformers=transformers.__version__, kvcc=kvcc.__version__, caches=caches, bf16_cache=args.bf16_cache,
                  cudnn_sdpa=bool(args.allow_cudnn_sdpa),
                  decode_steps=args.decode_steps - 1, narrow_8b=args.narrow_8b, prefix_tokens=args.prefix, reserve_gib=args.reserve_gib,
                  command=" ".join([sys.executable, "-m", "kvcc.bench_generate"] + (argv or sys.argv[1:])),
                  runs=runs)
    result["goals"] = goals(runs, max(contexts)) if "8b" in models else []
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    md = markdown(result)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
