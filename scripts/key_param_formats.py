#!/usr/bin/env python3
"""Per-channel key parameters in fewer bytes: the error each format adds on real keys.

Per-channel key pages (KIVI's keys, key_group_tokens = page) hold a (scale, zero) pair per channel
per page, two fp16 values: 512 bytes a 64-token page block of head_dim 128, against 256 for
per-token keys, so per-channel decode reads 5.6% more bytes. This measures, on a model's post-RoPE
keys, what 2-byte formats cost against the fp16 pair: the keys' squared error and the attention
logits' (q·(k - k̂), queries of the same KV head at the last positions), both summed over every
quantised page of every layer and KV head. The grid is codec_scalar.h's (no clip, 2 bits:
codes floor(x/s + z + 1/2) clamped to [0, 3], value (c - z)·s); a format rounds s (and z), and
the codes are computed against the rounded values, as an append would.

A proxy, not the model's KL: a format that passes here still needs `kvcc validate`.

usage: key_param_formats.py --model DIR --text FILE [--docs 3] [--tokens 2048]
"""
import argparse

import numpy as np
import torch
import transformers.models.llama.modeling_llama as llama
from transformers import AutoModelForCausalLM, AutoTokenizer

SINK, PAGE, RING = 64, 64, 256  # the runtime's defaults: the quantised pages lie between


def f16(x):
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def small_float(x, e_bits, m_bits, bias):
    """x >= 0 rounded to nearest on an unsigned float of e_bits exponent and m_bits mantissa bits
    (subnormals below 2^(1 - bias), saturating at the largest value)."""
    x = np.asarray(x, np.float64)
    e = np.clip(np.floor(np.log2(np.maximum(x, 1e-300))), 1 - bias, 2**e_bits - 1 - bias)
    step = np.exp2(e - m_bits)
    top = np.exp2(2**e_bits - 1 - bias) * (2 - 2.0**-m_bits)
    return np.minimum(np.round(x / step) * step, top).astype(np.float32)


def fp16_pair(lo, hi):  # today's format (codec_scalar.h's uniform_params)
    s = f16((hi - lo) / 3)
    s = np.where((s > 0) & np.isfinite(s), s, 1.0)
    return s, f16(-lo / s)


def byte_scale_int8_zero(e_bits, m_bits, bias, zero_steps):
    """A one-byte float scale (nearest) and a signed-byte zero in units of 1/zero_steps of a step."""

    def fmt(lo, hi):
        s = small_float((hi - lo) / 3, e_bits, m_bits, bias)
        s = np.where(s > 0, s, 1.0)
        z = -lo / s * zero_steps
        fmt.clamped += int(((z < -128) | (z > 127)).sum())
        fmt.zmax = max(fmt.zmax, float(np.abs(z).max()) / zero_steps)
        return s, np.clip(np.round(z), -128, 127) / zero_steps

    fmt.clamped, fmt.zmax = 0, 0.0
    return fmt


def page_log_scale(steps, up):
    """A byte of log2 steps (steps an octave) below the page's largest scale (fp16), rounded up (the
    range always covered) or to nearest, and an fp16 zero: 3 bytes a channel."""

    def fmt(lo, hi):
        s = (hi - lo) / 3
        top = f16(s.max())
        u = -steps * np.log2(np.maximum(s, 1e-30) / top)
        s = (top * np.exp2(-np.clip(np.floor(u) if up else np.round(u), 0, 255) / steps)).astype(np.float32)
        s = np.where(s > 0, s, 1.0)
        return s, f16(-lo / s)

    return fmt


FORMATS = {
    "fp16 scale + fp16 zero (4 B)": fp16_pair,
    "page log-scale/16 up + fp16 zero (3 B)": page_log_scale(16, True),
    "page log-scale/32 up + fp16 zero (3 B)": page_log_scale(32, True),
    "page log-scale/32 nearest + fp16 zero (3 B)": page_log_scale(32, False),
    "e5m3 scale + int8 zero/4 (2 B)": byte_scale_int8_zero(5, 3, 15, 4),
    "e4m4 scale + int8 zero/4 (2 B)": byte_scale_int8_zero(4, 4, 10, 4),
    "e5m3 scale + int8 zero/2 (2 B)": byte_scale_int8_zero(5, 3, 15, 2),
}


def capture(model_dir, text, docs, tokens):
    """Post-RoPE queries and keys of each layer, [heads, T, d] float32, for each document."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    got, eager = [], llama.eager_attention_forward

    def hook(module, query, key, value, attention_mask, **kw):
        got[-1][module.layer_idx] = (query[0].numpy().copy(), key[0].numpy().copy())
        return eager(module, query, key, value, attention_mask, **kw)

    llama.eager_attention_forward = hook
    try:
        for doc in [d.strip() for d in open(text).read().split("<|endoftext|>") if d.strip()][:docs]:
            got.append({})
            ids = tok(doc)["input_ids"][:tokens]
            with torch.no_grad():
                model(torch.tensor([ids]))
            print(f"document {len(got)}: {len(ids)} tokens", flush=True)
    finally:
        llama.eager_attention_forward = eager
    return got


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Llama model directory (transformers)")
    ap.add_argument("--text", required=True, help="documents separated by <|endoftext|>")
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens a document (at most)")
    a = ap.parse_args()
    if a.docs < 1 or a.tokens < SINK + PAGE + RING:
        ap.error(f"--docs >= 1 and --tokens >= {SINK + PAGE + RING} (a sink, one page and the ring)")
    err = {n: np.zeros(2) for n in FORMATS}
    norm, pages = 0.0, 0
    for layers in capture(a.model, a.text, a.docs, a.tokens):
        for q, k in layers.values():
            group = q.shape[0] // k.shape[0]
            T = k.shape[1]
            for h in range(k.shape[0]):
                Q = q[group * h : group * (h + 1), T - RING :].reshape(-1, q.shape[2])
                for p in range((T - SINK - RING) // PAGE):
                    K = k[h, SINK + p * PAGE : SINK + (p + 1) * PAGE]
                    lo, hi = K.min(0), K.max(0)
                    norm += float((K**2).sum())
                    pages += 1
                    for name, fmt in FORMATS.items():
                        s, z = fmt(lo, hi)
                        E = K - (np.clip(np.floor(K / s + z + 0.5), 0, 3) - z) * s
                        err[name] += [(E**2).sum(), ((Q @ E.T) ** 2).sum() / q.shape[2]]
    base = err["fp16 scale + fp16 zero (4 B)"]
    print(f"\n{pages} pages (layer, KV head, document)\n")
    print("| format | key squared error / key energy | key error vs fp16 pair | logit error vs fp16 pair | zeros clamped | largest |z| (steps) |")
    print("|---|---|---|---|---|---|")
    for name, (e, l) in err.items():
        fmt = FORMATS[name]
        extra = (f"{fmt.clamped} | {fmt.zmax:.1f}") if hasattr(fmt, "clamped") else "— | —"
        print(f"| {name} | {e / norm:.4e} | {e / base[0]:.4f}x | {l / base[1]:.4f}x | {extra} |")


if __name__ == "__main__":
    main()
