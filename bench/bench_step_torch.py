"""A decode step through the Python package, as a PyTorch engine would run it, against the BF16
cache step of bench_sdpa.py in the same process (CUDA events, median of many replays).

Per config, on a kvcc.Runtime of the artifact (bfloat16 activations, maxima declared):

- engine-graph: engine_tables=True; the engine's slots, lengths, counts and block table are
  device tensors; begin_step, every layer's append + decode_step and the lengths' increment are
  one torch.cuda graph, so each replay is the next step (one new token per sequence);
- graph: the Runtime's own tables; begin_append on the host (plans and uploads the step), then
  the layers' append + decode replayed from one graph: timed as begin_append + replay;
- the BF16 cache step (bench_sdpa.time_step: the new K/V written by index_copy_ at a
  device-held position, then the best SDPA form, every layer in one graph).

The sequences are first filled to the context with random K/V through the same runtime
(prefill appends of 8192 tokens a step). Reported per layer ("kind": "torch_step").
usage: bench_step_torch.py --artifact A.kvcc.h5 --configs Hq:Hkv:batch:ctx,... --out F.jsonl [--steps 200]
An artifact of the 8B attention shape with 4 layers (what bench_step times):
    python -m kvcc.bench_generate --make-artifact-8b A.kvcc.h5 --method-8b oscar --layers-8b 4
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_sdpa  # noqa: E402

import kvcc  # noqa: E402

FILL = 8192  # tokens per sequence per filling step


def fill(rt, step_tables, batch, ctx, gen_dev):
    """Grows every sequence to ctx - 1 tokens (the first decode step makes ctx)."""
    H, d = rt.n_kv_heads, rt.head_dim
    done = 0
    while done < ctx - 1:
        c = min(FILL, ctx - 1 - done)
        step_tables(done, c)
        k = torch.randn(batch * c, H, d, device="cuda", dtype=torch.bfloat16, generator=gen_dev)
        v = torch.randn(batch * c, H, d, device="cuda", dtype=torch.bfloat16, generator=gen_dev)
        for layer in range(rt.n_layers):
            rt.append(layer, k, v)
        done += c


def wall_per_layer(step, steps, layers):
    """Median over 5 runs of `steps` calls of step(), CUDA events around each run, per layer."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(steps):
            step()
        b.record()
        b.synchronize()
        runs.append(1000.0 * a.elapsed_time(b) / steps / layers)
    runs.sort()
    return runs[len(runs) // 2]


def engine_graph(art, hq, hkv, batch, ctx, steps):
    extra = 8 * steps + 64  # every timed step appends a token
    kw = dict(device="cuda", dtype=torch.bfloat16, max_batch=batch, max_context=ctx + extra,
              max_step_tokens=max(batch, batch * FILL))
    pages = kvcc.pages_for_tokens(kvcc.load_artifact(art), ctx + extra)
    rt = kvcc.Runtime(art, max_pages=batch * pages, max_sequences=batch, engine_tables=True, **kw)
    assert (rt.n_heads, rt.n_kv_heads) == (hq, hkv), "the artifact's heads differ from the config's"
    # The engine's tables: sequence i holds pages [i·pages, (i+1)·pages), slot i.
    slots = torch.arange(batch, dtype=torch.int32, device="cuda")
    table = torch.arange(batch * pages, dtype=torch.int32, device="cuda").reshape(batch, pages)
    lengths = torch.zeros(batch, dtype=torch.int32, device="cuda")
    counts = torch.zeros(batch, dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)

    def open_fill(done, c):
        lengths.fill_(done)
        counts.fill_(c)
        rt.begin_step(slots, lengths, counts, table, rows=batch * c)

    fill(rt, open_fill, batch, ctx, gen)
    lengths.fill_(ctx - 1)
    counts.fill_(1)
    layers, H, Hq, d = rt.n_layers, rt.n_kv_heads, rt.n_heads, rt.head_dim
    k = torch.randn(layers, batch, H, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    q = torch.randn(layers, batch, Hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    outs = [None] * layers
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            rt.begin_step(slots, lengths, counts, table, rows=batch)
            for layer in range(layers):
                rt.append(layer, k[layer], v[layer])
                outs[layer] = rt.decode_step(layer, q[layer])
            lengths.add_(1)
        us = wall_per_layer(graph.replay, steps, layers)
    torch.cuda.synchronize()
    problem = rt.step_problem()
    assert problem == "", problem
    finite = bool(torch.isfinite(outs[0]).all())
    rt.close()
    return us, finite


def own_graph(art, hq, hkv, batch, ctx, steps):
    extra = 8 * steps + 64
    kw = dict(device="cuda", dtype=torch.bfloat16, max_batch=batch, max_context=ctx + extra,
              max_step_tokens=max(batch, batch * FILL))
    pages = kvcc.pages_for_tokens(kvcc.load_artifact(art), ctx + extra)
    rt = kvcc.Runtime(art, max_pages=batch * pages, max_sequences=batch, **kw)
    seqs = [rt.add_sequence() for _ in range(batch)]
    gen = torch.Generator(device="cuda").manual_seed(1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fill(rt, lambda done, c: rt.begin_append(seqs, [c] * batch), batch, ctx, gen)
        layers, H, Hq, d = rt.n_layers, rt.n_kv_heads, rt.n_heads, rt.head_dim
        k = torch.randn(layers, batch, H, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        q = torch.randn(layers, batch, Hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        outs = [None] * layers
        rt.begin_append(seqs, [1] * batch)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for layer in range(layers):
                rt.append(layer, k[layer], v[layer])
                outs[layer] = rt.decode(layer, seqs, q[layer])
        graph.replay()

        def step():
            rt.begin_append(seqs, [1] * batch)
            graph.replay()

        us = wall_per_layer(step, steps, layers)
    torch.cuda.synchronize()
    finite = bool(torch.isfinite(outs[0]).all())
    rt.close()
    return us, finite


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--configs", required=True, help="Hq:Hkv:batch:ctx,...")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--reps", type=int, default=30, help="replays of the BF16 step")
    args = ap.parse_args()
    info = kvcc.load_artifact(args.artifact)
    B = bench_sdpa.SDPBackend
    backends = {"cudnn": B.CUDNN_ATTENTION, "flash": B.FLASH_ATTENTION, "efficient": B.EFFICIENT_ATTENTION}
    with open(args.out, "w") as out:
        for cfg in args.configs.split(","):
            hq, hkv, batch, ctx = (int(x) for x in cfg.split(":"))
            row = {"kind": "torch_step", "q_heads": hq, "kv_heads": hkv, "batch": batch, "context": ctx,
                   "layers": info.n_layers, "artifact": os.path.basename(args.artifact)}
            for name, fn in (("engine_graph", engine_graph), ("graph", own_graph)):
                us, finite = fn(args.artifact, hq, hkv, batch, ctx, args.steps)
                row[f"{name}_us_per_layer"] = round(us, 2)
                row[f"{name}_finite"] = finite
                torch.cuda.empty_cache()
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(f"torch step {hq}/{hkv} b={batch:<3d} ctx={ctx:<7d} {info.n_layers} layers: engine-graph "
                  f"{row['engine_graph_us_per_layer']:.1f} us, graph {row['graph_us_per_layer']:.1f} us per layer "
                  f"(bfloat16, host work included)", flush=True)
            bench_sdpa.time_step(out, backends, hq, hkv, batch, ctx, info.n_layers, args.reps, "cuda")
    return 0


if __name__ == "__main__":
    sys.exit(main())
