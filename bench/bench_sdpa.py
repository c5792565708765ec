"""BF16 decode attention through PyTorch SDPA (cuDNN, flash and memory-efficient backends), on the
shapes bench_decode times, with the same method: a CUDA graph of R calls over R distinct K/V
replicas, CUDA events, median of many replays after warm-up, random non-zero data.

Two call forms per backend: GQA folded into the query length (q [B, Hkv, r, d] against
K/V [B, Hkv, L, d], no K/V expansion) and enable_gqa=True (q [B, Hq, 1, d]). The best is the
baseline.

--step-layers N also times what bench_step times for the INT2 cache, a whole decode step of N
layers over a BF16 cache as an engine runs it: per layer the new token's K and V written into the
layer's preallocated cache [B, Hkv, L, d] at a position held on the device (index_copy_, so the
graph replays for any position), then SDPA (either form, the best kept) over the L tokens; every layer captured in
one CUDA graph; reported per layer ("kind": "sdpa_step").

--prefill-configs Hq:Hkv:ctx:T,... times what bench_prefill times for the INT2 cache: T new tokens
attending over ctx cached ones and causally over themselves (q [1, Hq, T, d] against K/V
[1, Hkv, ctx + T, d], GQA by enable_gqa), through every backend that takes the bottom-right causal
mask (torch.nn.attention.bias.causal_lower_right); the fastest is the baseline ("kind":
"sdpa_prefill"). Each backend is also timed without a mask over all ctx + T keys (more work than
the causal problem, reported as "no_mask", not the baseline). TFLOP/s counts as bench_prefill does.
usage: bench_sdpa.py [--configs Hq:Hkv:batch:ctx,...] [--prefill-configs Hq:Hkv:ctx:T,...]
                     --out sdpa.jsonl [--step-layers 4]
"""
import argparse
import itertools
import json
import math
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def time_graph(fn, reps):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    del graph
    return 1000.0 * times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="")
    ap.add_argument("--prefill-configs", default="")
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--step-layers", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    backends = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    with open(args.out, "w") as out:
        for item in filter(None, args.prefill_configs.split(",")):
            time_prefill(out, backends, *(int(x) for x in item.split(":")), args.reps, dev)
        for item in filter(None, args.configs.split(",")):
            hq, hkv, batch, ctx = (int(x) for x in item.split(":"))
            r = hq // hkv
            d = 128
            kv_bytes = batch * hkv * ctx * d * 2 * 2
            R = int(min(16, max(1, math.ceil(512e6 / kv_bytes))))
            ks = [torch.randn(batch, hkv, ctx, d, device=dev, dtype=torch.bfloat16) for _ in range(R)]
            vs = [torch.randn(batch, hkv, ctx, d, device=dev, dtype=torch.bfloat16) for _ in range(R)]
            q_grouped = torch.randn(batch, hkv, r, d, device=dev, dtype=torch.bfloat16)
            q_gqa = q_grouped.reshape(batch, hq, 1, d)
            best = None
            for name, backend in backends.items():
                for form in ("grouped", "enable_gqa"):
                    outs = [None] * R

                    def run():
                        with sdpa_kernel([backend]):
                            for i in range(R):
                                if form == "grouped":
                                    outs[i] = F.scaled_dot_product_attention(q_grouped, ks[i], vs[i])
                                else:
                                    outs[i] = F.scaled_dot_product_attention(q_gqa, ks[i], vs[i], enable_gqa=True)

                    try:
                        us = time_graph(run, args.reps) / R
                        finite = bool(torch.isfinite(outs[0]).all().item())
                    except Exception as e:  # a backend that does not take this shape
                        msg = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
                        out.write(json.dumps({"kind": "sdpa", "q_heads": hq, "kv_heads": hkv, "batch": batch,
                                              "context": ctx, "backend": name, "form": form, "error": msg}) + "\n")
                        torch.cuda.synchronize()
                        continue
                    rec = {"kind": "sdpa", "q_heads": hq, "kv_heads": hkv, "batch": batch, "context": ctx,
                           "backend": name, "form": form, "us": round(us, 3), "gbps": round(kv_bytes / us / 1e3, 1),
                           "outputs_finite": finite, "replicas": R}
                    out.write(json.dumps(rec) + "\n")
                    out.flush()
                    if finite and (best is None or us < best[0]):
                        best = (us, name, form)
            if best:
                print(f"sdpa {hq:2d}/{hkv} b={batch:<3d} ctx={ctx:<6d} best {best[0]:8.1f} us ({best[1]}, {best[2]}), "
                      f"{kv_bytes / best[0] / 1e3:6.0f} GB/s", flush=True)
            else:
                print(f"sdpa {hq}/{hkv} b={batch} ctx={ctx}: no backend ran", flush=True)
            del ks, vs
            torch.cuda.empty_cache()
            if args.step_layers > 0:
                time_step(out, backends, hq, hkv, batch, ctx, args.step_layers, args.reps, dev)
    return 0


def time_prefill(out, backends, hq, hkv, ctx, T, reps, dev):
    from torch.nn.attention.bias import causal_lower_right

    d = 128
    q = torch.randn(1, hq, T, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, hkv, ctx + T, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, hkv, ctx + T, d, device=dev, dtype=torch.bfloat16)
    flops = 4.0 * hq * d * (ctx * T + 0.5 * T * T)
    mask = causal_lower_right(T, ctx + T)
    best = None
    for (name, backend), masked in itertools.product(backends.items(), (True, False)):
        outs = [None]

        def run():
            with sdpa_kernel([backend]):
                outs[0] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask if masked else None, enable_gqa=True)

        rec = {"kind": "sdpa_prefill", "q_heads": hq, "kv_heads": hkv, "context": ctx, "T": T, "backend": name,
               "mask": "causal_lower_right" if masked else "no_mask"}
        try:
            us = time_graph(run, reps)
            finite = bool(torch.isfinite(outs[0]).all().item())
        except Exception as e:  # a backend that does not take this shape or mask
            rec["error"] = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            out.write(json.dumps(rec) + "\n")
            torch.cuda.synchronize()
            continue
        rec.update({"ms": round(us / 1e3, 4), "tflops": round(flops / us / 1e6, 1), "outputs_finite": finite})
        out.write(json.dumps(rec) + "\n")
        out.flush()
        if masked and finite and (best is None or us < best[0]):
            best = (us, name)
    if best:
        print(f"sdpa prefill {hq:2d}/{hkv} ctx={ctx:<6d} T={T:<5d} best {best[0] / 1e3:8.3f} ms ({best[1]}, causal "
              f"lower right), {flops / best[0] / 1e6:6.1f} TFLOP/s", flush=True)
    else:
        print(f"sdpa prefill {hq}/{hkv} ctx={ctx} T={T}: no backend took the causal mask", flush=True)
    del q, k, v
    torch.cuda.empty_cache()


def time_step(out, backends, hq, hkv, batch, ctx, layers, reps, dev):
    r, d = hq // hkv, 128
    kc = [torch.randn(batch, hkv, ctx, d, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
    vc = [torch.randn(batch, hkv, ctx, d, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
    k1 = [torch.randn(batch, hkv, 1, d, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
    v1 = [torch.randn(batch, hkv, 1, d, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
    q = [torch.randn(batch, hkv, r, d, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
    pos = torch.tensor([ctx - 1], device=dev)  # the new token's slot: the graph reads it from the device
    best = None
    for (name, backend), form in itertools.product(backends.items(), ("grouped", "enable_gqa")):
        outs = [None] * layers

        def step():
            with sdpa_kernel([backend]):
                for l in range(layers):
                    kc[l].index_copy_(2, pos, k1[l])
                    vc[l].index_copy_(2, pos, v1[l])
                    if form == "grouped":
                        outs[l] = F.scaled_dot_product_attention(q[l], kc[l], vc[l])
                    else:
                        outs[l] = F.scaled_dot_product_attention(q[l].reshape(batch, hq, 1, d), kc[l], vc[l],
                                                                 enable_gqa=True)

        try:
            us = time_graph(step, reps) / layers
            finite = bool(torch.isfinite(outs[0]).all().item())
        except Exception as e:
            msg = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            out.write(json.dumps({"kind": "sdpa_step", "q_heads": hq, "kv_heads": hkv, "batch": batch,
                                  "context": ctx, "backend": name, "form": form, "layers": layers,
                                  "error": msg}) + "\n")
            torch.cuda.synchronize()
            continue
        out.write(json.dumps({"kind": "sdpa_step", "q_heads": hq, "kv_heads": hkv, "batch": batch, "context": ctx,
                              "backend": name, "form": form, "layers": layers, "us_per_layer": round(us, 3),
                              "outputs_finite": finite}) + "\n")
        out.flush()
        if finite and (best is None or us < best[0]):
            best = (us, name, form)
    if best:
        print(f"sdpa step {hq:2d}/{hkv} b={batch:<3d} ctx={ctx:<6d} {layers} layers: best {best[0]:8.1f} us per layer "
              f"(cache write + {best[1]}, {best[2]})", flush=True)
    del kc, vc
    torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
