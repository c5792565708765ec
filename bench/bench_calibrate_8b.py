"""Calibration of an 8B-shaped model on one GPU: both producers side by side in one run.

Builds a Llama with Llama-3.1-8B's configuration (32 layers, hidden 4096, 32 / 8 heads, head_dim
128, intermediate 14336, vocab 128256, llama3 RoPE scaling) and random BF16 weights on the GPU,
saves it as safetensors, writes random token ids (documents of --max-seq-len tokens), then times

- `kvcc calibrate-model --device gpu` (the C++ layer-streamed forward on cuBLAS, float32), and
- `python -m kvcc.calibrate --device cuda --dtype D` (the PyTorch producer) for each --py-dtypes D,
  run twice (the first run on a machine also compiles and caches the Triton kernel; the second is reported),

each as a user runs it (a process, model load included), and the plain forward of the same tokens
in each dtype through transformers (SDPA, no statistics, no LM head) as the reference for what
statistics cost the PyTorch producer. Prints a markdown table and writes --json.

    python bench/bench_calibrate_8b.py --kvcc build-gpu/cli/kvcc --work /tmp/cal8b --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LLAMA_31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                   rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8192))


def build_model(path: Path, layers: int) -> float:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    t0 = time.perf_counter()
    torch.manual_seed(0)
    cfg = LlamaConfig(**dict(LLAMA_31_8B, num_hidden_layers=layers))
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    return time.perf_counter() - t0


def write_ids(path: Path, tokens: int, length: int) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        left = tokens
        while left > 0:
            n = min(length, left)
            f.write(" ".join(str(rng.randrange(LLAMA_31_8B["vocab_size"])) for _ in range(n)) + "\n")
            left -= n


def run(cmd: list[str], env=None) -> tuple[float, str]:
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        sys.stderr.write(res.stdout + res.stderr)
        raise SystemExit(f"failed ({res.returncode}): {' '.join(cmd)}")
    return wall, res.stderr


def plain_forward(model_dir: Path, ids_path: Path, tokens: int, dtype_name: str) -> dict:
    """The decoder layers (SDPA, no cache, no LM head) over the same sequences."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    model = model.to("cuda").eval()
    seqs = [list(map(int, line.split())) for line in open(ids_path)]
    used, batches = 0, []
    for s in seqs:
        if used >= tokens:
            break
        s = s[: tokens - used]
        used += len(s)
        batches.append(torch.tensor([s], device="cuda"))
    with torch.inference_mode():
        model.model(input_ids=batches[0], use_cache=False)  # warm-up (kernel selection)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for ids in batches:
            model.model(input_ids=ids, use_cache=False)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache()
    return {"tokens": used, "seconds": seconds}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kvcc", help="the kvcc CLI (a CUDA build); without it only the PyTorch producer runs")
    p.add_argument("--work", default="/tmp/kvcc-cal8b", help="where the model, ids and stats go")
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--layers", type=int, default=32, help="decoder layers (32: the 8B model)")
    p.add_argument("--py-dtypes", default="bfloat16,float32", help="dtypes of the PyTorch producer's runs")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.tokens < 1 or args.max_seq_len < 1 or args.layers < 1:
        raise SystemExit("--tokens, --max-seq-len and --layers must be positive")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model_dir, ids = work / "llama-3.1-8b-random", work / "ids.txt"
    build_s = build_model(model_dir, args.layers) if not (model_dir / "config.json").exists() else 0.0
    write_ids(ids, args.tokens, args.max_seq_len)
    common = ["--model", str(model_dir), "--ids", str(ids), "--tokens", str(args.tokens), "--max-seq-len",
              str(args.max_seq_len)]
    results: dict = {"config": dict(LLAMA_31_8B, num_hidden_layers=args.layers), "tokens": args.tokens,
                     "max_seq_len": args.max_seq_len, "build_seconds": build_s}

    env = dict(os.environ, PYTHONPATH=str(HERE.parent / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rows = []
    if args.kvcc:
        wall, log = run([args.kvcc, "calibrate-model", *common, "--device", "gpu", "-o", str(work / "cpp.stats.h5")])
        m = re.search(r"layers forward ([\d.]+) s, statistics ([\d.]+) s on the GPU", log)
        c = results["cpp_gpu"] = {"wall_s": wall, "forward_s": float(m.group(1)) if m else None,
                                  "stats_s": float(m.group(2)) if m else None, "log": log.strip().splitlines()[-2:]}
        rows.append(("kvcc calibrate-model --device gpu (float32)", c["wall_s"],
                     f"forward {c['forward_s']:.1f} s, statistics {c['stats_s']:.1f} s = "
                     f"{100 * c['stats_s'] / c['forward_s']:.0f}% of the forward" if c["forward_s"] else "-"))
    for dtype in args.py_dtypes.split(","):
        # Twice: the first process on a machine compiles the Triton kernel (BF16/FP16), which Triton
        # caches on disk; the second is what every later run costs. Both are recorded.
        py = {}
        for key in ("first", "second"):
            wall, log = run([sys.executable, "-m", "kvcc.calibrate", *common, "--device", "cuda", "--dtype", dtype,
                             "-o", str(work / f"py-{dtype}.stats.h5")], env=env)
            m = re.search(r"of the layers' ([\d.]+) s .*the first sequence ([\d.]+) s", log)
            py[key] = {"wall_s": wall, "layers_s": float(m.group(1)) if m else None,
                       "first_sequence_s": float(m.group(2)) if m else None, "log": log.strip().splitlines()[-1:]}
        py = dict(py["second"], first=py["first"], plain_forward=plain_forward(model_dir, ids, args.tokens, dtype))
        results[f"py_cuda_{dtype}"] = py
        plain = py["plain_forward"]["seconds"]
        first = py["first"]["layers_s"]
        if py["layers_s"] and first:
            # Per token with the first sequence apart on both sides (the plain forward's warm-up pass is
            # untimed; the producer's first sequence also loads kernels): what the statistics cost.
            first_tokens = min(args.max_seq_len, args.tokens)
            steady = (py["layers_s"] - py["first_sequence_s"]) / max(args.tokens - first_tokens, 1)
            py["statistics_share_steady"] = steady / (plain / args.tokens) - 1
            note = (f"layers {py['layers_s']:.1f} s (first run on the machine {first:.1f} s; first sequence "
                    f"{py['first_sequence_s']:.2f} s) vs plain {dtype} forward {plain:.1f} s: statistics "
                    f"+{100 * (py['layers_s'] - plain) / plain:.0f}% in all, "
                    f"+{100 * py['statistics_share_steady']:.0f}% per token after the first sequence")
        else:
            note = "-"
        rows.append((f"python -m kvcc.calibrate --device cuda --dtype {dtype}", py["wall_s"], note))
        print(rows[-1], flush=True)
        if args.json:  # after each run, so a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"\n{args.tokens} tokens, documents of {args.max_seq_len}, {args.layers} layers "
          f"(model built and saved in {build_s:.0f} s)\n")
    print("| producer | wall (process, model load included) | where the time goes |\n|---|---|---|")
    for name, wall_s, note in rows:
        print(f"| {name} | {wall_s:.1f} s | {note} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
