"""GPU check of python -m kvcc.calibrate --device cuda (run by hand on a CUDA machine; CPU CI skips it).

Builds a small random-weight Llama with transformers (saved as safetensors, GQA 4:1), writes random
token ids, runs the producer on the CPU and on the GPU over the same ids, and compares every dataset
of the two stats files (integers exactly, floats to the float32-rounding tolerance of
stats_compare.float_tolerance). Prints the largest differences and both runs' times.

    PYTHONPATH=python python python/tests/gpu_calibrate_cuda.py [WORKDIR]
"""

from __future__ import annotations

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


def main() -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    work = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="kvcc-gpu-"))
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
