"""GPU check of python -m kvcc.calibrate --device cuda (run by hand on a CUDA machine; CPU CI skips it).

Builds a small random-weight Llama with transformers (saved as safetensors, GQA 4:1), writes random
token ids, runs the producer on the CPU and on the GPU over the same ids, and compares every dataset
of the two stats files (integers exactly, floats to the float32-rounding tolerance of
stats_compare.float_tolerance). Prints the largest differences and both runs' times.

With --cli KVCC and --real MODEL_DIR:IDS_FILE (repeatable; ids from `kvcc tokenize`), each real model
is also calibrated by the PyTorch producer on the GPU and by `kvcc calibrate-model --device gpu`,
and the two files are compared the same way (the C++ GPU path against the C++ CPU path is
tests/gpu_test_calibrate.cu's).

    PYTHONPATH=python python python/tests/gpu_calibrate_cuda.py [WORKDIR] [--cli K --real M:I ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import stats_compare as tc  # noqa: E402


def check_real(work: Path, cli: str, model: str, ids: str, env: dict) -> None:
    """PyTorch producer (cuda, float32) vs kvcc calibrate-model --device gpu on one real model."""
    common = ["--model", model, "--ids", ids, "--tokens", "16384", "--max-seq-len", "512", "--reservoir", "512",
              "--seed", "7"]
    name = Path(model).name
    cpp, py = work / f"{name}.cpp-gpu.h5", work / f"{name}.py-cuda.h5"
    for cmd in ([cli, "calibrate-model", *common, "--device", "gpu", "-o", str(cpp)],
                [sys.executable, "-m", "kvcc.calibrate", *common, "--device", "cuda", "-o", str(py)]):
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if res.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr}")
    cfg = json.loads((Path(model) / "config.json").read_text())
    shape = {"n_layers": cfg["num_hidden_layers"], "hidden": cfg["hidden_size"],
             "intermediate": cfg["intermediate_size"]}
    tol = tc.float_tolerance(shape, 512)
    worst = tc.compare_stats(cpp, py, tol)
    print(f"{name}: python cuda vs kvcc --device gpu: tolerance {tol:.2e}; largest |py - c| / max|c|: "
          + ", ".join(f"{k} {v:.1e}" for k, v in sorted(worst.items())))


def check_fused(work: Path, model_dir: Path, ids: Path, env: dict) -> None:
    """--dtype bfloat16 on the GPU: the fused attention (flash output + the Triton p2 pass) against
    --attention exact on layer 0, where both see the same activations: q/k/v sums, ranges and
    reservoir rows identical; p2 within float32 rounding of the scores and exponentials (1e-4);
    output_m2 within the BF16 rounding of the output the fused path returns (2 · 2^-9, bound 2^-7)."""
    files = {}
    for mode in ("auto", "exact"):
        files[mode] = work / f"bf16-{mode}.h5"
        res = subprocess.run([sys.executable, "-m", "kvcc.calibrate", "--model", str(model_dir), "--ids", str(ids),
                              "--max-seq-len", "1024", "--reservoir", "256", "--device", "cuda", "--dtype", "bfloat16",
                              "--attention", mode, "-o", str(files[mode])], capture_output=True, text=True, env=env)
        if res.returncode != 0:
            raise SystemExit(res.stderr)
        print(f"bf16 {mode}: {res.stderr.strip().splitlines()[-1]}")
    import h5py
    with h5py.File(files["auto"], "r") as fa, h5py.File(files["exact"], "r") as fe:
        a, e = tc._flatten(fa), tc._flatten(fe)
    worst = {}
    for key in sorted(k for k in e if k.startswith("/layers/0/")):
        x, y = a[key], e[key]
        if not isinstance(x, tuple):
            continue
        x, y = np.asarray(x[1], dtype=np.float64), np.asarray(y[1], dtype=np.float64)
        name = key.rsplit("/", 1)[-1]
        err = float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-300))
        bound = 2.0 ** -7 if name == "output_m2" else 1e-4 if name.startswith("p2") else 0.0
        assert err <= bound, f"{key}: fused vs exact {err:.2e} > {bound:.1e}"
        worst[name] = max(worst.get(name, 0.0), err)
    for key in (k for k in e if k.startswith("/layers/0/") and "@p2_weight" in k):
        err = abs(float(a[key]) - float(e[key])) / abs(float(e[key]))
        assert err <= 1e-4, f"{key}: {err:.2e}"
        worst["p2_weight"] = max(worst.get("p2_weight", 0.0), err)
    print("bf16 fused vs exact attention, layer 0: " + ", ".join(f"{k} {v:.1e}" for k, v in sorted(worst.items())))


def main() -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    p = argparse.ArgumentParser()
    p.add_argument("work", nargs="?")
    p.add_argument("--cli", help="a CUDA build of the kvcc CLI (for --real)")
    p.add_argument("--real", action="append", default=[], help="MODEL_DIR:IDS_FILE")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="kvcc-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model_dir = work / "random-llama"
    model.save_pretrained(model_dir, safe_serialization=True)
    rng = np.random.default_rng(0)
    ids = work / "ids.txt"
    ids.write_text("".join(" ".join(map(str, rng.integers(3, 1024, size=int(n)))) + "\n"
                           for n in rng.integers(200, 1024, size=12)))
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    times = {}
    for device in ("cpu", "cuda"):
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "kvcc.calibrate", "--model", str(model_dir), "--ids", str(ids),
                              "--max-seq-len", "1024", "--reservoir", "256", "--device", device, "-o",
                              str(work / f"{device}.h5")], capture_output=True, text=True, env=env)
        times[device] = time.perf_counter() - t0
        print(res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "")
        if res.returncode != 0:
            print(res.stderr)
            return 1
    tol = tc.float_tolerance({"n_layers": 4, "hidden": 512, "intermediate": 1536}, 1024)
    worst = tc.compare_stats(work / "cpu.h5", work / "cuda.h5", tol)
    print(f"cuda vs cpu: tolerance {tol:.2e}; largest |cuda - cpu| / max|cpu|: "
          + ", ".join(f"{k} {v:.1e}" for k, v in sorted(worst.items())))
    print(f"wall time (process, model load included): cpu {times['cpu']:.1f} s, cuda {times['cuda']:.1f} s")
    check_fused(work, model_dir, ids, env)
    for item in args.real:
        if not args.cli:
            raise SystemExit("--real needs --cli")
        model, ids = item.rsplit(":", 1)
        check_real(work, args.cli, model, ids, env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
