"""Joins bench_prefill.jsonl (kvcc's INT2 prefill, the whole call), bench_prefill_before.jsonl (the
same benchmark of BEFORE_TREE, lines prefixed "before ") and sdpa_prefill.jsonl (PyTorch SDPA in
BF16 on the same shapes) from one `gpu_run.sh prefill` into prefill_results.md, one row per shape
and kvcc build (warps; 0 is the plan's choice). "vs best causal" is the best causal SDPA backend's
time over kvcc's: above 1, kvcc is faster. bench_sdpa.py times PyTorch as a CUDA graph's replay;
"graph vs best causal" compares kvcc's call timed the same way ("graph ms"), the plain ratio its
direct call, which also holds the host's planning and launches ("host ms" of it on the host).
cuDNN without a mask computes every new token against every new token (more work than the causal
mask) and is shown for reference only.
usage: prefill_report.py OUT_DIR [--activations bf16|f32|all]"""
import argparse
import json
import os


def load(path, prefix=""):
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith(prefix):
                line = line[len(prefix):]
            if line.startswith("{"):
                rows.append(json.loads(line))
    return rows


def report(out_dir, activations="bf16"):
    if not os.path.exists(os.path.join(out_dir, "bench_prefill.jsonl")):
        raise SystemExit(f"prefill_report.py: no bench_prefill.jsonl in {out_dir}")
    kvcc = [r for r in load(os.path.join(out_dir, "bench_prefill.jsonl")) if r.get("bench") == "prefill"]
    before = {(r["q_heads"], r["kv_heads"], r["ctx"], r["T"], r["warps"], r["activations"]): r["ms"]
              for r in load(os.path.join(out_dir, "bench_prefill_before.jsonl"), "before ")
              if r.get("bench") == "prefill"}
    sdpa = {}  # shape -> {(backend, mask): ms}
    for r in load(os.path.join(out_dir, "sdpa_prefill.jsonl")):
        if "ms" in r and r.get("outputs_finite", True):
            sdpa.setdefault((r["q_heads"], r["kv_heads"], r["context"], r["T"]), {})[(r["backend"], r["mask"])] = r["ms"]
    head = ["Hq:Hkv", "context", "T", "act", "warps", "kvcc ms", "TFLOP/s", "host ms", "graph ms", "before ms",
            "FA2 causal", "cuDNN causal", "best causal", "cuDNN no mask", "vs best causal", "graph vs best causal"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    fmt = lambda x: "—" if x is None else f"{x:.4g}"
    for r in kvcc:
        if activations != "all" and r["activations"] != activations:
            continue
        shape = (r["q_heads"], r["kv_heads"], r["ctx"], r["T"])
        s = sdpa.get(shape, {})
        causal = [ms for (backend, mask), ms in s.items() if mask.startswith("causal")]
        best = min(causal) if causal else None
        b = before.get(shape + (r["warps"], r["activations"]))
        lines.append("| " + " | ".join([
            f"{r['q_heads']}:{r['kv_heads']}", str(r["ctx"]), str(r["T"]), r["activations"], str(r["warps"]),
            fmt(r["ms"]), f"{r['tflops']:.0f}", fmt(r.get("host_ms")), fmt(r.get("graph_ms")), fmt(b),
            fmt(s.get(("flash", "causal_lower_right"))), fmt(s.get(("cudnn", "causal_lower_right"))), fmt(best),
            fmt(s.get(("cudnn", "no_mask"))), "—" if best is None else f"{best / r['ms']:.2f}×",
            "—" if best is None or "graph_ms" not in r else f"{best / r['graph_ms']:.2f}×"]) + " |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "prefill_results.md"), "w") as f:
        f.write(text)
    return text


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--activations", default="bf16", choices=["bf16", "f32", "all"])
    a = ap.parse_args()
    print(report(a.out_dir, a.activations), end="")
