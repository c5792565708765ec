"""PyTorch calibration producer: ``python -m kvcc.calibrate``.

Runs a transformers model over calibration text and writes the attention statistics of
``kvcc calibrate-model`` in the same kvcc-stats v1 schema (docs/formats.md), so ``kvcc compile``,
``merge-stats`` and the zoo read it unchanged. The model's attention is replaced by a function
registered with transformers' AttentionInterface that sees the post-RoPE queries and keys and the
values of every layer; it computes the attention probabilities blockwise (float32, as the C++
forward pass; for BF16/FP16 on a CUDA GPU, flash attention's output and a Triton pass for the p2
weights instead, see --attention), returns the attention output to the model, and accumulates in
float64 on the model's device:

- query_m2 (Σ q qᵀ over the r query heads of a KV head), key_m2, value_m2, per-channel ranges;
- the value targets output_m2 (Σ o oᵀ per query head) and p2_m2 (Σ_j w_j v_j v_jᵀ with
  w_j = Σ_heads Σ_i p_ij²) and p2_weight;
- the reservoir rows (q, pre-RoPE key, key, value) of the tokens with the smallest sampling
  priorities, the priority being the C++ splitmix64 hash of (seed, doc, position).

Text is split, truncated and budgeted exactly as calibrate/driver.cpp does, and tokenized with
the model's tokenizer.json through the `tokenizers` library (the fast tokenizer transformers
uses), BOS prefixed as the model config says. Needs torch, transformers, numpy and h5py.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import shlex
import sys
import time

import numpy as np

from kvcc._quantized import QuantizedCheckpoint, pair_weight_scales, read_quantization
from kvcc._stats_h5 import (KvccError, ModelConfig, make_fingerprint, read_model_config, require, weight_entries,
                            weight_headers, weights_sha256, write_stats)

DEFAULT_SEPARATOR = "<|endoftext|>"
ATTN_NAME = "kvcc_calibrate"


def _version() -> str:
    try:
        from kvcc import __version__  # the package's version (the CMake project VERSION)
        return str(__version__)
    except Exception:
        return "0.1.0"


# ---------------------------------------------------------------------------------------------
# Input: documents, tokens, budget (calibrate/driver.cpp prepare_calibration_set)

_WHITESPACE = " \t\n\r\f\v"


def split_documents(text: str, separator: str = DEFAULT_SEPARATOR) -> list[str]:
    """model/tokenizer.cpp split_documents: split on the separator, trim ASCII whitespace, drop empty."""
    pieces = [text] if separator == "" else text.split(separator)
    return [s for s in (p.strip(_WHITESPACE) for p in pieces) if s]


def splitmix64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def reservoir_priority(seed: int, doc: int, positions: np.ndarray) -> np.ndarray:
    """calibrate/accumulators.cpp reservoir_priority for one document, vectorized over positions."""
    token = (np.uint64(doc) << np.uint64(32)) | np.asarray(positions, dtype=np.uint64)
    s = splitmix64(np.array([seed], dtype=np.uint64))
    return splitmix64(s ^ splitmix64(token ^ np.uint64(0xA0761D6478BD642F)))


def _tokenizer_kind(tok_json: dict) -> str:
    """Tokenizer::kind() of model/tokenizer_hf.cpp: what provenance.tokenizer records."""

    def steps(node):
        if not isinstance(node, dict):
            return []
        if node.get("type") == "Sequence":
            out = []
            for key in ("pretokenizers", "normalizers"):
                for sub in node.get(key) or []:
                    out += steps(sub)
            return out
        return [node]

    pre = steps(tok_json.get("pre_tokenizer"))
    if any(s.get("type") == "ByteLevel" for s in pre):
        return "tokenizer.json (byte-level BPE)"
    meta = any(s.get("type") == "Metaspace" for s in pre)
    for s in steps(tok_json.get("normalizer")):
        if s.get("content") == "\u2581" or s.get("prepend") == "\u2581":
            meta = True
    return "tokenizer.json (metaspace BPE)" if meta else "tokenizer.json (BPE)"


def _template_bos_prefix(tok_json: dict) -> list[int]:
    """The special tokens before $A in the post-processor's single template (the C++ BOS prefix)."""
    prefix: list[int] = []

    def walk(pp):
        if not isinstance(pp, dict):
            return
        if pp.get("type") == "Sequence":
            for sub in pp.get("processors") or []:
                walk(sub)
        elif pp.get("type") == "TemplateProcessing":
            for item in pp.get("single") or []:
                if "Sequence" in item:
                    break
                name = item["SpecialToken"]["id"]
                require(name in pp.get("special_tokens", {}), f"the template's special token \"{name}\" is not defined")
                prefix.extend(int(i) for i in pp["special_tokens"][name]["ids"])

    walk(tok_json.get("post_processor"))
    return prefix


class DocumentEncoder:
    """Encodes documents as model/tokenizer_hf.cpp does: no special tokens from the
    post-processor, then the template's BOS prefix when the model config adds BOS."""

    def __init__(self, model_dir: str, tokenizer_path: str, config: ModelConfig):
        import json

        path = tokenizer_path or os.path.join(model_dir, "tokenizer.json")
        require(os.path.isfile(path), f"no tokenizer.json in model directory {model_dir}" if not tokenizer_path
                else f"tokenizer file '{tokenizer_path}' does not exist or is not a file")
        try:
            from tokenizers import Tokenizer
            self.tokenizer = Tokenizer.from_file(path)
            with open(path, "r", encoding="utf-8") as f:
                tok_json = json.load(f)
        except Exception as e:  # the tokenizers library raises its own exception type
            raise KvccError(f"tokenizer {path}: cannot load ({e})") from None
        self.kind = _tokenizer_kind(tok_json)
        self.prefix = _template_bos_prefix(tok_json) if config.add_bos else []
        if config.add_bos and not self.prefix and config.bos_id >= 0:
            self.prefix = [config.bos_id]  # tokenizers without a template: the config's BOS
        n = self.tokenizer.get_vocab_size(with_added_tokens=True)
        padded = n < config.vocab and (config.vocab - n) * 100 < config.vocab
        require(n == config.vocab or padded, f"tokenizer has {n} tokens but the model's vocabulary is {config.vocab}")

    def encode(self, text: str) -> list[int]:
        return self.prefix + list(self.tokenizer.encode(text, add_special_tokens=False).ids)


def read_token_id_file(path: str) -> list[list[int]]:
    """model/tokenizer.cpp read_token_id_file: whitespace-separated decimal ids, one document per line."""
    docs = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            line = raw.rstrip(b"\n")
            ids = []
            for tok in line.replace(b"\t", b" ").replace(b"\r", b" ").split(b" "):
                if not tok:
                    continue
                require(tok.isdigit() or (tok[:1] == b"-" and tok[1:].isdigit()),
                        f"{path}:{number}: '{tok.decode(errors='replace')}' is not a token id")
                v = int(tok)
                require(-(2**31) <= v < 2**31, f"{path}:{number}: token id {v} is out of range")
                ids.append(v)
            docs.append(ids)
    return docs


def prepare_calibration_set(args, config: ModelConfig, encoder_factory) -> dict:
    max_len = args.max_seq_len or 0
    model_max = config.max_position if config.max_position > 0 else 2048
    if max_len == 0:
        max_len = min(model_max, 2048)
    require(max_len > 0, "--max-seq-len must be positive")
    require(max_len <= model_max, f"--max-seq-len {max_len} exceeds the model's maximum position {model_max}")
    budget = args.tokens or 0
    sequences: list[list[int]] = []
    doc_index: list[int] = []
    total = 0

    def add(ids, doc) -> bool:
        nonlocal total
        if budget > 0 and total >= budget:
            return False
        ids = ids[:max_len]
        if budget > 0:
            ids = ids[:budget - total]
        if not ids:
            return True
        for i in ids:
            require(0 <= i < config.vocab, f"token id {i} in document {doc} is outside the model's vocabulary of "
                    f"{config.vocab} (ids made by another tokenizer?)")
        total += len(ids)
        sequences.append(ids)
        doc_index.append(doc)
        return True

    if args.ids:
        require(os.path.isfile(args.ids), f"token id file '{args.ids}' does not exist or is not a file")
        with open(args.ids, "rb") as f:
            sha = hashlib.sha256(f.read()).hexdigest()
        kind = "ids"
        for i, ids in enumerate(read_token_id_file(args.ids)):
            if not add(ids, i):
                break
        require(total > 0, f"token id file '{args.ids}' holds no tokens")
    else:
        require(os.path.isfile(args.data), f"calibration text '{args.data}' does not exist or is not a file")
        with open(args.data, "rb") as f:
            raw = f.read()
        sha = hashlib.sha256(raw).hexdigest()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise KvccError(f"calibration text '{args.data}' is not valid UTF-8 (byte {e.start})") from None
        docs = split_documents(text, args.separator)
        require(docs, f"calibration text '{args.data}' holds no documents (empty or whitespace only)")
        encoder = encoder_factory()
        kind = encoder.kind
        for i, doc in enumerate(docs):
            if not add(encoder.encode(doc), i):
                break
        require(total > 0, f"calibration text '{args.data}' gave no tokens")
    return {"sequences": sequences, "doc_index": doc_index, "tokens": total, "max_seq_len": max_len,
            "tokenizer": kind, "data_sha256": sha}


# ---------------------------------------------------------------------------------------------
# Statistics


class _StopForward(Exception):
    """Raised after the last layer's attention: nothing after it is read (as the C++ driver skips
    the last layer's MLP)."""


def _gram(x, chunk: int = 256):
    """Σ over rows of x xᵀ for x [..., n, d] (float64), as a split-K batch of products of `chunk`
    rows added in order: one [d, n] x [n, d] product per head spreads only d × d outputs over a
    GPU."""
    import torch

    n, d = x.shape[-2], x.shape[-1]
    if n <= chunk:
        return x.transpose(-1, -2) @ x
    pad = (-n) % chunk
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    x = x.reshape(*x.shape[:-2], (n + pad) // chunk, chunk, d)
    return (x.transpose(-1, -2) @ x).sum(dim=-3)


class StatsCollector:
    """Per-layer float64 accumulators on the model's device, and the reservoir rows."""

    M2_NAMES = ("query_m2", "output_m2", "key_m2", "value_m2", "p2_m2")  # the order of `sums`
    PINNED_ROWS_BYTES = 8 << 30  # above: each sequence's rows copied to pageable memory, waiting

    def __init__(self, config: ModelConfig, device, sampled: dict, block_bytes: int, fused: bool = True):
        import torch

        self.torch = torch
        self.c = config
        self.device = device
        L, K, d = config.n_layers, config.n_kv_heads, config.head_dim
        f64 = dict(dtype=torch.float64, device=device)
        # One tensor per kind, so a layer's sums take two additions and the ranks reduce three tensors.
        self.sums = torch.zeros((L, len(self.M2_NAMES), K, d, d), **f64)
        self.lo = torch.full((L, 2, K, d), math.inf, **f64)  # key, value
        self.hi = torch.full((L, 2, K, d), -math.inf, **f64)
        self.p2_weight = torch.zeros((L, K), **f64)
        # Each layer's destinations as views made once: an update is then in-place adds, no indexing.
        self.layer_views = [(self.sums[l, 0], self.sums[l, 0:2].view(2 * K, d, d), self.sums[l, 2:5].view(3 * K, d, d),
                             self.lo[l], self.hi[l], self.p2_weight[l]) for l in range(L)]
        self.kv_count = [0] * L
        self.sampled = sampled  # sequence index -> (positions int64 array, priorities uint64 array)
        self.rows: list[list[tuple]] = [[] for _ in range(L)]  # per layer: (seq, q, key_pre, key, value)
        # Reservoir rows on their way to the host: this sequence's per layer on the device, then one
        # asynchronous copy per sequence (a synchronous copy per layer would stall the host's launches).
        self.seq_rows = None  # [L, H + 3K, n, d] on the device while a sequence runs
        self.copied_rows: list[tuple] = []  # (seq, host tensor [L, n, H + 3K, d])
        self._place_reservoir(device)
        self.block_bytes = block_bytes
        self.seq = -1
        self.pending_pre_key = None  # (input k, output k) of the last apply_rotary_pos_emb call
        self.stats_seconds = 0.0
        self.fused = None if fused else False  # None: decided on the first layer (_fused_attention)

    def attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """The registered attention function: returns the model's attention output and accumulates."""
        torch = self.torch
        t0 = time.perf_counter()
        c = self.c
        layer = int(getattr(module, "layer_idx"))
        require(query.shape[0] == 1, "internal: calibration runs one sequence at a time")
        require(kwargs.get("softcap") is None and kwargs.get("s_aux") is None and getattr(module, "sinks", None) is None,
                "the model's attention uses logit soft-capping or sink logits, which the producer does not model")
        _, H, T, d = query.shape
        K = key.shape[1]
        require(H == c.n_heads and K == c.n_kv_heads and d == c.head_dim and key.shape[2] == T,
                f"layer {layer}: attention shapes q {tuple(query.shape)} k {tuple(key.shape)} do not match the "
                f"config ({c.n_heads}/{c.n_kv_heads} heads, head_dim {c.head_dim}, no cache)")
        r = H // K
        scale = float(scaling) if scaling is not None else d ** -0.5
        window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))

        if self._fused_attention(query, window):
            result, w = self._flash_attention(query, key, value, scale)  # result [1, T, H, d]
            self._accumulate(layer, query[0], key[0], value[0], result[0].transpose(0, 1), w)
        else:
            cdt = torch.float64 if query.dtype == torch.float64 else torch.float32
            out, w = self._exact_attention(layer, query[0].to(cdt).reshape(K, r, T, d), key[0].to(cdt),
                                           value[0].to(cdt), scale, window)
            self._accumulate(layer, query[0], key[0], value[0], None, w)
            result = out.reshape(H, T, d).transpose(0, 1).unsqueeze(0).to(query.dtype)
        self._gather_rows(layer, query, key, value)
        self.stats_seconds += time.perf_counter() - t0
        if layer == c.n_layers - 1:
            raise _StopForward()
        return result, None

    def _accumulate(self, layer, q, k, v, out, w):
        """Adds one sequence's sums to layer `layer`: q [H, T, d], k and v [K, T, d] in the
        activations' dtype, out [H, T, d] or None (the exact path added output_m2 itself), w [K, T]
        float64. Each operand is converted once, straight into a float64 buffer the Grams read."""
        torch = self.torch
        H, T, d = q.shape
        K = k.shape[0]
        query_m2, query_output_m2, kv_m2, lo, hi, p2_weight = self.layer_views[layer]
        qo = torch.empty((H if out is None else 2 * H, T, d), dtype=torch.float64, device=q.device)
        qo[:H].copy_(q)
        if out is not None:
            qo[H:].copy_(out)
        kvw = torch.empty((3 * K, T, d), dtype=torch.float64, device=q.device)
        kvw[:K].copy_(k)
        kvw[K:2 * K].copy_(v)
        torch.mul(kvw[K:2 * K], w.sqrt()[:, :, None], out=kvw[2 * K:])  # rows of p2_m2: sqrt(w_j) v_j
        (query_m2 if out is None else query_output_m2).add_(_gram(qo.view(-1, (H // K) * T, d)))
        kv_m2.add_(_gram(kvw))
        batch_lo, batch_hi = torch.aminmax(kvw[:2 * K].view(2, K, T, d), dim=2)
        torch.minimum(lo, batch_lo, out=lo)
        torch.maximum(hi, batch_hi, out=hi)
        p2_weight.add_(w.sum(dim=1))
        self.kv_count[layer] += T

    def _gather_rows(self, layer, query, key, value):
        """This sequence's reservoir rows of one layer, gathered into one device buffer
        [L, H + 3K, n, d]; after the last layer they leave for the host in one asynchronous copy
        (finish() waits for it)."""
        torch = self.torch
        slot = self.slots.get(self.seq)
        if slot is None:
            return
        pre = self._pre_rope_key(key, layer)
        c = self.c
        H, K = c.n_heads, c.n_kv_heads
        if layer == 0:
            self.seq_index = self.positions[slot[0]:slot[1]]
            self.seq_rows = torch.empty((c.n_layers, H + 3 * K, slot[1] - slot[0], c.head_dim), dtype=query.dtype,
                                        device=query.device)
        dst = self.seq_rows[layer]
        for t, a, b in ((query, 0, H), (pre, H, H + K), (key, H + K, H + 2 * K), (value, H + 2 * K, H + 3 * K)):
            if t.dtype == dst.dtype:
                torch.index_select(t[0], 1, self.seq_index, out=dst[a:b])
            else:
                dst[a:b].copy_(t[0].index_select(1, self.seq_index))
        if layer == c.n_layers - 1:
            # float32 [L, n, H + 3K, d] made on the device in one conversion: the host then only slices it.
            src = self.seq_rows.permute(0, 2, 1, 3)
            rows = torch.empty(src.shape, dtype=torch.float32, device=src.device).copy_(src)
            self.seq_rows = None
            if self.host_rows is not None:  # this sequence's block of the flat buffer (contiguous)
                a, b = slot
                host = self.host_rows[rows.shape[0] * a * rows[0, 0].numel():rows.shape[0] * b * rows[0, 0].numel()]
                rows = host.view(rows.shape).copy_(rows, non_blocking=True)
            elif rows.is_cuda:
                rows = rows.cpu()
            self.copied_rows.append((self.seq, rows))

    def _place_reservoir(self, device):
        """Every sampled position uploaded once, before the forward passes, and (on a GPU) one pinned
        host buffer for all reservoir rows, which each sequence's rows are copied into without
        waiting: a pinned allocation or a pageable copy per sequence would stall the device's queue."""
        torch = self.torch
        c = self.c
        self.slots, n = {}, 0
        for s in sorted(self.sampled):
            self.slots[s] = (n, n + len(self.sampled[s][0]))
            n = self.slots[s][1]
        flat = np.concatenate([self.sampled[s][0] for s in sorted(self.sampled)]) if n else np.zeros(0, np.int64)
        positions = torch.as_tensor(flat.astype(np.int64))
        self.host_rows = None
        nbytes = 4 * c.n_layers * n * (c.n_heads + 3 * c.n_kv_heads) * c.head_dim
        if device.type == "cuda":
            positions = positions.pin_memory().to(device, non_blocking=True)
            if 0 < nbytes <= self.PINNED_ROWS_BYTES:
                self.host_rows = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=True)
        self.positions = positions

    def finish(self):
        """Waits for the device (and so for the reservoir rows' copies) and files the rows per layer
        as float32 views [n, K, r, d] / [n, K, d] (what reservoirs() and the ranks' gather read)."""
        torch = self.torch
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        c = self.c
        H, K, d = c.n_heads, c.n_kv_heads, c.head_dim
        for seq, rows in self.copied_rows:
            n = rows.shape[1]
            for layer in range(c.n_layers):
                x = rows[layer]
                self.rows[layer].append((seq, x[:, :H].reshape(n, K, H // K, d), x[:, H:H + K], x[:, H + K:H + 2 * K],
                                         x[:, H + 2 * K:]))
        self.copied_rows = []

    def _exact_attention(self, layer, q, k, v, scale, window):
        """Causal attention in the activations' float precision over blocks of query rows (the
        probabilities of one block materialised, as the C++ forward does): returns the output
        [K, r, T, d] and the p2 column weights w [K, T] (float64); accumulates output_m2."""
        torch = self.torch
        K, r, T, d = q.shape
        # One block holds K·r·b·T probabilities (float32 and float64).
        b = max(1, min(T, self.block_bytes // max(1, K * r * T * 12)))
        out = torch.empty((K, r, T, d), dtype=q.dtype, device=q.device)
        w = torch.zeros((K, T), dtype=torch.float64, device=q.device)
        pos = torch.arange(T, device=q.device)
        for i0 in range(0, T, b):
            i1 = min(T, i0 + b)
            j1 = i1  # causal: keys after the block's last row get zero probability
            s = (q[:, :, i0:i1] @ k[:, None, :j1].transpose(-1, -2)) * scale  # [K, r, b, j1]
            rows, cols = pos[i0:i1, None], pos[None, :j1]
            masked = cols > rows
            if window is not None:
                masked = masked | (rows - cols >= int(window))
            s = s.masked_fill(masked, -math.inf)
            p = torch.softmax(s, dim=-1)
            o = p @ v[:, None, :j1]  # [K, r, b, d]
            out[:, :, i0:i1] = o
            self.sums[layer, 1] += _gram(o.double().reshape(K, r * (i1 - i0), d))
            w[:, :j1] += p.double().square().sum(dim=(1, 2))
        return out, w

    def _fused_attention(self, query, window) -> bool:
        """BF16/FP16 activations on a CUDA GPU that has flash attention: the model's kind of
        attention kernel gives the output (rounded to the activations' dtype, as the model's own
        attention returns it) and a Triton pass recomputes the probabilities for w, so no T × T
        matrix is materialised. Float32 keeps the exact path (the CPU path's rounding)."""
        if self.fused is None:
            torch = self.torch
            d = query.shape[-1]
            self.fused = False
            if query.is_cuda and torch.cuda.get_device_capability(query.device) >= (8, 0) and 16 <= d <= 256 \
                    and d & (d - 1) == 0:
                try:
                    import triton  # noqa: F401  (torch's CUDA wheels bring it)
                    self.fused = True
                except ImportError:
                    pass
        return self.fused and query.dtype in (self.torch.bfloat16, self.torch.float16) and window is None

    def _flash_attention(self, query, key, value, scale):
        """query [1, H, T, d], key and value [1, K, T, d] as the model passes them (views of its
        [1, T, heads, d] projections): the flash kernel reads them in place, the KV heads shared by
        their query heads (no repeated copies). Returns the output [1, T, H, d] in query's dtype and w."""
        from kvcc._p2_triton import p2_column_weights

        torch = self.torch
        _, H, T, d = query.shape
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        res = torch.ops.aten._flash_attention_forward(q, k, v, None, None, T, T, 0.0, True, False, scale=scale)
        out, lse = res[0], res[1]  # [1, T, H, d], [1, H, T] float32 (natural log)
        return out, p2_column_weights(query[0], key[0], lse[0], scale, H // key.shape[1])

    def _pre_rope_key(self, key, layer):
        pending = self.pending_pre_key
        self.pending_pre_key = None
        require(pending is not None and pending[1] is key,
                f"layer {layer}: the pre-RoPE key was not seen (the model's attention does not call its module's "
                "apply_rotary_pos_emb); the reservoir needs it")
        return pending[0]

    def heads(self):
        """Per (layer, KV head) dicts for the writer: matrices mirrored from the upper triangle."""
        sums, lo, hi = (t.cpu().numpy() for t in (self.sums, self.lo, self.hi))  # one copy each, not per head
        m2 = {name: sums[:, i] for i, name in enumerate(self.M2_NAMES)}
        ranges = {"key_min": lo[:, 0], "value_min": lo[:, 1], "key_max": hi[:, 0], "value_max": hi[:, 1]}
        p2_weight = self.p2_weight.cpu().numpy()
        out = []
        for layer in range(self.c.n_layers):
            row = []
            for h in range(self.c.n_kv_heads):
                hs = {}
                for name, m in m2.items():
                    upper = np.triu(m[layer, h])
                    hs[name] = upper + np.triu(upper, 1).T
                for name, m in ranges.items():
                    hs[name] = m[layer, h].copy()
                hs["query_count"] = self.kv_count[layer] * self.c.group
                hs["output_count"] = self.kv_count[layer] * self.c.group
                hs["kv_count"] = self.kv_count[layer]
                hs["p2_weight"] = float(p2_weight[layer, h])
                row.append(hs)
            out.append(row)
        return out

    def reservoirs(self, doc_index):
        """Rows in ascending priority, as reservoir_merge leaves them."""
        torch = self.torch
        c = self.c
        out = []
        for layer in range(c.n_layers):
            parts = self.rows[layer]
            if parts:
                seqs = np.concatenate([np.full(len(self.sampled[s][0]), s) for s, *_ in parts])
                position = np.concatenate([self.sampled[s][0] for s, *_ in parts]).astype(np.int32)
                priority = np.concatenate([self.sampled[s][1] for s, *_ in parts])
                q, kp, k, v = (torch.cat([p[i] for p in parts]).numpy() for i in range(1, 5))
            else:
                seqs = np.zeros(0, np.int64)
                position = np.zeros(0, np.int32)
                priority = np.zeros(0, np.uint64)
                q = np.zeros((0, c.n_kv_heads, c.group, c.head_dim), np.float32)
                kp = k = v = np.zeros((0, c.n_kv_heads, c.head_dim), np.float32)
            order = np.argsort(priority, kind="stable")
            docs = np.asarray(doc_index, dtype=np.uint32)[seqs[order]] if len(order) else np.zeros(0, np.uint32)
            row = []
            for h in range(c.n_kv_heads):
                row.append({"q": q[order, h], "key_pre": kp[order, h], "key": k[order, h], "value": v[order, h],
                            "position": position[order], "doc": docs, "priority": priority[order],
                            "heldout": (docs % 5 == 4).astype(np.uint8)})
            out.append(row)
        return out


def select_reservoir(set_: dict, local: list[int], seed: int, capacity: int) -> dict:
    """The `capacity` smallest priorities over this process's tokens (the union reservoir_merge
    keeps, independent of order); a priority already seen is a duplicate and skipped, as there."""
    if capacity == 0 or not local:
        return {}
    pri = [reservoir_priority(seed, set_["doc_index"][s], np.arange(len(set_["sequences"][s]))) for s in local]
    allp = np.concatenate(pri)
    owner = np.concatenate([np.full(len(p), i) for i, p in enumerate(pri)])
    posn = np.concatenate([np.arange(len(p)) for p in pri])
    _, first = np.unique(allp, return_index=True)  # first occurrence of each priority, sorted by priority
    keep = first[:capacity]
    sampled = {}
    for i in np.unique(owner[keep]):
        sel = keep[owner[keep] == i]
        sel = sel[np.argsort(posn[sel])]
        sampled[local[int(i)]] = (posn[sel].astype(np.int64), allp[sel])
    return sampled


# ---------------------------------------------------------------------------------------------
# Model


_ACTIVE: list = []  # the collector the registered attention function feeds


def _attention_trampoline(module, query, key, value, attention_mask, *args, **kwargs):
    require(bool(_ACTIVE), "the kvcc_calibrate attention runs only inside kvcc.calibrate")
    return _ACTIVE[-1].attention(module, query, key, value, attention_mask, *args, **kwargs)


def _register_attention() -> None:
    """Registered once before loading, so from_pretrained accepts attn_implementation=kvcc_calibrate."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _attention_trampoline)


def _hook_rope(model, collector: StatsCollector) -> list:
    """Wraps apply_rotary_pos_emb in each attention module's Python module, so the pre-RoPE key (after
    any k_norm) is seen together with the post-RoPE key the attention function then receives."""
    patched = []
    modules = {type(m).__module__ for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj")}
    for name in modules:
        mod = sys.modules.get(name)
        fn = getattr(mod, "apply_rotary_pos_emb", None)
        if fn is None or getattr(fn, "_kvcc_wrapped", False):
            continue

        def wrapped(q, k, *args, _fn=fn, **kw):
            q_out, k_out = _fn(q, k, *args, **kw)
            collector.pending_pre_key = (k, k_out)
            return q_out, k_out

        wrapped._kvcc_wrapped = True
        setattr(mod, "apply_rotary_pos_emb", wrapped)
        patched.append((mod, fn))
    return patched


def load_model(model_dir: str, config: ModelConfig, device: str, dtype_name: str):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]
    quantization = read_quantization(model_dir)
    checkpoint = None
    try:
        if quantization.method:
            # FP8 weights: dequantized by kvcc (kvcc/_quantized.py says why) into the state dict of
            # the same model without its quantization_config.
            from transformers import AutoConfig

            checkpoint = QuantizedCheckpoint(model_dir, quantization)
            hf_config = AutoConfig.from_pretrained(model_dir)
            del hf_config.quantization_config
            model_class = AutoModelForCausalLM._model_mapping[type(hf_config)]
            model, info = model_class.from_pretrained(None, config=hf_config, state_dict=checkpoint.state_dict,
                                                      dtype=dtype, attn_implementation=ATTN_NAME,
                                                      output_loading_info=True)
        else:
            # FP8 tensors without a quantization_config are refused, not loaded as they are.
            pair_weight_scales(quantization, weight_entries(model_dir), model_dir, read_tensor=None)
            model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=ATTN_NAME,
                                                               output_loading_info=True)
    except KvccError:
        raise
    except Exception as e:
        raise KvccError(f"{model_dir}: transformers cannot load the model ({type(e).__name__}: {e})") from None
    finally:
        if checkpoint is not None:
            checkpoint.close()
    missing = [k for k in info.get("missing_keys", []) if not (config.tied_embeddings and k == "lm_head.weight")]
    require(not missing, f"{model_dir}: the checkpoint lacks tensors the model needs: {', '.join(sorted(missing)[:5])}"
            + (" ..." if len(missing) > 5 else ""))
    # A NaN or Inf weight would spread into every later activation: refuse it, naming the tensor.
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            bad = (~torch.isfinite(p)).flatten().nonzero()[0].item()
            raise KvccError(f"{model_dir}: tensor {name} holds a non-finite value "
                            f"({p.flatten()[bad].item()} at element {bad})")
    if not config.known_architecture:
        config.qk_norm = any(hasattr(m, "k_norm") for m in model.modules())
    model.eval()
    return model.to(device)


# ---------------------------------------------------------------------------------------------
# Command


def _parse_shard(text: str):
    try:
        i, n = text.split("/")
        i, n = int(i), int(n)
        ok = n >= 1 and 0 <= i < n
    except ValueError:
        ok = False
    require(ok, f"--shard '{text}' is not I/N with 0 <= I < N (e.g. --shard 0/4)")
    return i, n


def _same_path(a: str, b: str) -> bool:
    if os.path.exists(a) and os.path.exists(b):
        return os.path.samefile(a, b)
    return os.path.realpath(a) == os.path.realpath(b)


def build_parser() -> argparse.ArgumentParser:
    def whole(lo):
        def parse(s):
            try:
                v = int(s, 10)
            except ValueError:
                raise argparse.ArgumentTypeError(f"'{s}' is not a whole number") from None
            if v < lo or v > 2**63 - 1:
                raise argparse.ArgumentTypeError(f"{v} is out of range (want >= {lo})")
            return v
        return parse

    p = argparse.ArgumentParser(
        prog="python -m kvcc.calibrate",
        description="Run a transformers model over calibration text and write its attention statistics "
                    "(stats.h5, the schema of `kvcc calibrate-model`).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Hooks the model's attention (post-RoPE queries and keys, values, the attention probabilities\n"
               "computed blockwise) and accumulates in float64 on --device the query second moment, the value\n"
               "targets, key/value moments and ranges, and a reservoir of sampled rows (documents with\n"
               "index % 5 == 4 held out), as `kvcc calibrate-model` does over the same tokens.\n\n"
               "Under torchrun (torch.distributed, NCCL on GPUs, gloo on CPUs) rank R takes the documents with\n"
               "index % WORLD_SIZE == R on cuda:LOCAL_RANK (--device cuda) or the CPU; rank 0 adds up every\n"
               "rank's sums and reservoir rows, as `kvcc merge-stats` would, and writes the file.\n\n"
               "Examples:\n"
               "  python -m kvcc.calibrate --model ../shared/models/tinystories-656k \\\n"
               "      --data ../shared/text/tinystories_valid_100.txt --tokens 20000 -o stats.h5\n"
               "  kvcc compile stats.h5 --method oscar --key-bits 2 --value-bits 2 -o model.kvcc.h5\n"
               "  torchrun --standalone --nproc-per-node 8 -m kvcc.calibrate --model MODEL_DIR --data calib.txt \\\n"
               "      --tokens 65536 --device cuda -o stats.h5")
    p.add_argument("--model", required=True, help="Hugging Face model directory (config.json, *.safetensors, "
                   "tokenizer.json)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--data", help="Calibration text; documents are separated by --separator")
    src.add_argument("--ids", help="Pre-tokenized input instead of --data: one document per line, "
                     "whitespace-separated token ids")
    p.add_argument("--tokenizer", default="", help="tokenizer.json to use (default: the model's own)")
    p.add_argument("--tokens", type=whole(1), default=0, help="Stop after this many tokens in total (default: all)")
    p.add_argument("--max-seq-len", type=whole(1), default=0,
                   help="Truncate each document to this many tokens (default: min(model context, 2048))")
    p.add_argument("--reservoir", type=whole(1), default=2048, help="Sampled token rows kept per layer and KV head "
                   "(default 2048)")
    p.add_argument("--seed", type=whole(0), default=0, help="Seed of the reservoir sampling (default 0)")
    p.add_argument("--separator", default=DEFAULT_SEPARATOR, help="Document separator in the text")
    p.add_argument("--shard", default="", help="Process only documents with index %% N == I (I/N); merge the "
                   "shards with `kvcc merge-stats`")
    p.add_argument("-o", "--output", required=True, help="Statistics file to write (HDF5)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="Precision of the model's forward pass (default float32, as `kvcc calibrate-model`); "
                        "statistics are float64 whatever this is")
    p.add_argument("--attention", default="auto", choices=("auto", "exact"),
                   help="auto: with --dtype bfloat16/float16 on a CUDA GPU, flash attention gives the output and a "
                        "Triton pass recomputes the probabilities for the p2 target (no T x T matrix); exact: "
                        "probabilities materialised in float32 blocks for every dtype (what float32 always does)")
    p.add_argument("--block-mib", type=whole(1), default=256,
                   help="Memory for one block of attention probabilities (default 256 MiB)")
    p.add_argument("--dist-backend", default="auto", choices=("auto", "nccl", "gloo"),
                   help="Under torchrun: the torch.distributed backend (auto: nccl with --device cuda, else gloo)")
    return p


class _Distributed:
    """The torch.distributed job this process belongs to (torchrun's WORLD_SIZE / RANK / LOCAL_RANK),
    or a single process (world 1). Rank R calibrates documents with index % world == R; rank 0
    receives the reduced sums and the gathered reservoir rows and writes the file."""

    def __init__(self, backend_name: str, device_name: str):
        env = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
        try:
            self.world = int(env["WORLD_SIZE"] or 1)
            self.rank = int(env["RANK"] or 0)
            self.local_rank = int(env["LOCAL_RANK"] or 0)
        except ValueError:
            raise KvccError(f"WORLD_SIZE / RANK / LOCAL_RANK are not integers ({env})") from None
        require(self.world >= 1 and 0 <= self.rank < self.world,
                f"RANK {self.rank} is not within WORLD_SIZE {self.world}")
        self.dist = None
        self.backend = ""
        if self.world == 1:
            return
        import torch
        import torch.distributed as dist

        cuda = device_name.startswith("cuda")
        require(not cuda or device_name == "cuda", f"--device {device_name} under torchrun: give --device cuda, "
                "each rank then takes cuda:LOCAL_RANK")
        self.backend = backend_name if backend_name != "auto" else ("nccl" if cuda else "gloo")
        require(self.backend != "nccl" or cuda, "--dist-backend nccl needs --device cuda (NCCL reduces GPU tensors)")
        require(dist.is_available(), "this torch build has no torch.distributed")
        if cuda:
            require(torch.cuda.is_available() and self.local_rank < torch.cuda.device_count(),
                    f"rank {self.rank}: no CUDA device {self.local_rank} (LOCAL_RANK) is available")
            torch.cuda.set_device(self.local_rank)
        try:
            dist.init_process_group(self.backend, init_method="env://")
        except Exception as e:  # torch raises several types for a bad rendezvous
            raise KvccError(f"rank {self.rank}: torch.distributed ({self.backend}) did not start "
                            f"({type(e).__name__}: {e})") from None
        self.dist = dist

    def device(self, name: str):
        import torch

        return torch.device(f"cuda:{self.local_rank}") if self.dist is not None and name == "cuda" \
            else torch.device(name)

    def any_failed(self, failed: bool, device) -> bool:
        """Whether any rank failed, agreed by all before any collective that a failed rank would not join."""
        if self.dist is None:
            return failed
        import torch

        flag = torch.tensor([1 if failed else 0], dtype=torch.int32,
                            device=device if self.backend == "nccl" else "cpu")
        self.dist.all_reduce(flag, op=self.dist.ReduceOp.MAX)
        return bool(flag.item())

    def reduce(self, t, op: str) -> None:
        """In place on rank 0: the sum, minimum or maximum of t over the ranks."""
        ops = {"sum": self.dist.ReduceOp.SUM, "min": self.dist.ReduceOp.MIN, "max": self.dist.ReduceOp.MAX}
        src = t.cpu() if self.backend == "gloo" and t.is_cuda else t  # gloo reduces host tensors
        self.dist.reduce(src, dst=0, op=ops[op])
        if src is not t:
            t.copy_(src)

    def gather(self, obj) -> list:
        """obj of every rank, in rank order, on rank 0 (None elsewhere)."""
        out = [None] * self.world if self.rank == 0 else None
        self.dist.gather_object(obj, out, dst=0)
        return out

    def close(self, finished: bool = False):
        """Ends the process group. finished: every rank got here normally, so they first meet at a
        barrier: a rank tearing gloo down while rank 0 still writes the output aborted at exit
        ("terminate called without an active exception", once in a full 2-core test run)."""
        if self.dist is not None:
            if finished:
                self.dist.barrier()
            self.dist.destroy_process_group()
            self.dist = None


def _reduce_to_rank0(job: _Distributed, collector: StatsCollector, all_sampled: dict) -> None:
    """Sums, ranges, counts and reservoir rows of every rank into rank 0's collector (merge-stats'
    addition: the reservoir is the union of the ranks' rows, which were chosen globally)."""
    torch = collector.torch
    job.reduce(collector.sums, "sum")
    job.reduce(collector.lo, "min")
    job.reduce(collector.hi, "max")
    job.reduce(collector.p2_weight, "sum")
    counts = torch.tensor(collector.kv_count, dtype=torch.int64, device=collector.p2_weight.device)
    job.reduce(counts, "sum")
    collector.kv_count = [int(c) for c in counts.cpu().tolist()]
    rows = [[(s, *(t.numpy() for t in parts)) for s, *parts in layer] for layer in collector.rows]
    gathered = job.gather(rows)
    if job.rank == 0:
        collector.rows = [[(s, *(torch.from_numpy(a) for a in arrays)) for rank_rows in gathered
                           for s, *arrays in rank_rows[layer]] for layer in range(len(rows))]
        collector.sampled = all_sampled


def run(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    require(args.seed < 2**64, "--seed must fit in 64 bits")
    require(args.reservoir < 2**31, "--reservoir must be below 2^31")
    require(bool(args.data) or bool(args.ids), "give the calibration input: --data TEXT or --ids FILE")
    for inp in (args.model, args.data, args.ids, args.tokenizer):
        if inp:
            require(not _same_path(args.output, inp), f"the output {args.output} is the input {inp}; writing it "
                    "would replace the input: choose another output path")
    out_dir = os.path.dirname(args.output) or "."
    require(os.path.isdir(out_dir), f"output directory '{out_dir}' does not exist")
    shard_index, shard_count = _parse_shard(args.shard) if args.shard else (0, 1)
    job = _Distributed(args.dist_backend, args.device)
    try:
        result = _run(args, argv, job, shard_index, shard_count)
    except BaseException:
        job.close()
        raise
    job.close(finished=True)
    return result


def _run(args, argv, job: _Distributed, shard_index: int, shard_count: int) -> dict:
    import torch

    if job.world > 1:
        require(not args.shard, "--shard under torchrun: the ranks split the documents themselves (index % "
                "WORLD_SIZE == RANK); run without --shard")
        shard_index, shard_count = job.rank, job.world
    lead = job.rank == 0
    device = job.device(args.device)
    if device.type == "cuda":
        require(torch.cuda.is_available(), f"--device {args.device}: no CUDA device is available")
    t_start = time.perf_counter()
    config = read_model_config(args.model)
    headers = weight_headers(args.model)
    set_ = prepare_calibration_set(args, config, lambda: DocumentEncoder(args.model, args.tokenizer, config))
    everything = list(range(len(set_["sequences"])))
    local = [s for s in everything if set_["doc_index"][s] % shard_count == shard_index]
    local_tokens = sum(len(set_["sequences"][s]) for s in local)
    # Under torchrun the reservoir is chosen over all documents on every rank (the smallest
    # priorities of the union, as merging the ranks' own would give), each rank gathering its part.
    pool = everything if job.world > 1 else local
    all_sampled = select_reservoir(set_, pool, args.seed, args.reservoir)
    local_set = set(local)
    sampled = {s: v for s, v in all_sampled.items() if s in local_set}

    tty = sys.stderr.isatty() and lead
    collector = None
    failure = None
    t0 = time.perf_counter()
    seconds_layers = first_seconds = 0.0
    try:
        _register_attention()
        model = load_model(args.model, config, str(device), args.dtype)
        collector = StatsCollector(config, device, sampled, args.block_mib << 20, fused=args.attention == "auto")
        _ACTIVE.append(collector)
        patched = _hook_rope(model, collector)
        ranks = f", {job.world} ranks ({job.backend})" if job.world > 1 else ""
        if lead:
            print(f"calibrating on {local_tokens} tokens, {config.n_layers} layers, device {device}{ranks}",
                  file=sys.stderr)
        done = 0
        last = time.perf_counter()
        t0 = last
        try:
            with torch.inference_mode():
                for n_seq, s in enumerate(local):
                    ids = torch.tensor([set_["sequences"][s]], dtype=torch.long, device=device)
                    collector.seq = s
                    try:
                        model(input_ids=ids, use_cache=False)
                        raise KvccError("internal: the forward pass ended before the last layer's attention")
                    except _StopForward:
                        pass
                    done += ids.shape[1]
                    if n_seq == 0:  # a first pass also loads kernels and grows the allocator: timed apart
                        if device.type == "cuda":
                            torch.cuda.synchronize(device)
                        first_seconds = time.perf_counter() - t0
                    now = time.perf_counter()
                    if lead and (now - last >= (0.2 if tty else 10.0) or n_seq + 1 == len(local)):
                        last = now
                        rate = done / max(now - t0, 1e-9)
                        eta = (local_tokens - done) / rate if rate > 0 else 0.0
                        msg = (f"{done}/{local_tokens} tokens ({100.0 * done / max(local_tokens, 1):.0f}%), "
                               f"{rate:.0f} tok/s, ETA {eta:.0f} s")
                        print(("\r\033[K" + msg) if tty else msg, end="" if tty else "\n", file=sys.stderr,
                              flush=True)
            if tty:
                print(file=sys.stderr)
        finally:
            _ACTIVE.remove(collector)
            for mod, fn in patched:
                setattr(mod, "apply_rotary_pos_emb", fn)
        collector.finish()  # waits for the device and the reservoir rows' copies
        seconds_layers = time.perf_counter() - t0
    except Exception as e:  # raised again below, once every rank knows
        failure = e
    if job.any_failed(failure is not None, device):
        if failure is not None:
            raise failure
        raise KvccError(f"rank {job.rank}: stopped because another rank failed (its error is above)")
    tokens, sequences = local_tokens, len(local)
    if job.world > 1:
        _reduce_to_rank0(job, collector, all_sampled)
        tokens, sequences = set_["tokens"], len(everything)
        if not lead:
            return {"tokens": local_tokens, "sequences": len(local), "seconds": time.perf_counter() - t_start}

    heads = collector.heads()
    for layer in range(config.n_layers):
        for h in range(config.n_kv_heads):
            for name in ("query_m2", "output_m2", "p2_m2", "key_m2", "value_m2"):
                require(np.isfinite(heads[layer][h][name]).all(), f"layer {layer} kv{h}: {name} is not finite "
                        "(the forward pass produced NaN or Inf)")
    reservoirs = collector.reservoirs(set_["doc_index"])
    fingerprint = make_fingerprint(config, weights_sha256(headers))
    command = "python -m kvcc.calibrate " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                               else sys.argv[1:]))
    provenance = {"data_sha256": set_["data_sha256"], "tokens": tokens, "sequences": sequences,
                  "seed": args.seed, "max_seq_len": set_["max_seq_len"], "tokenizer": set_["tokenizer"]}
    write_stats(args.output, producer=f"kvcc {_version()} (python -m kvcc.calibrate, torch {torch.__version__})",
                command=command, config=config, fingerprint=fingerprint, provenance=provenance, heads=heads,
                reservoirs=reservoirs, capacity=args.reservoir)
    total = time.perf_counter() - t_start
    stats_share = 100.0 * collector.stats_seconds / seconds_layers if seconds_layers > 0 else 0.0
    on = f" ({job.world} ranks; rank 0's share below)" if job.world > 1 else ""
    print(f"calibrated {tokens} tokens in {sequences} sequences in {total:.1f} s "
          f"({tokens / max(total, 1e-9):.0f} tok/s){on}; attention and statistics {collector.stats_seconds:.2f} s "
          f"of the layers' {seconds_layers:.2f} s ({stats_share:.0f}%; the first sequence {first_seconds:.2f} s)",
          file=sys.stderr)
    print(f"wrote {args.output}")
    return {"tokens": tokens, "sequences": sequences, "seconds": total}


def main(argv=None) -> int:
    try:
        run(argv)
    except KvccError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
