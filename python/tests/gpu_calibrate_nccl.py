"""GPU check of python -m kvcc.calibrate under torchrun with NCCL (run by hand on a machine with two
or more CUDA devices; CPU CI runs the gloo version, test_calibrate_distributed.py).

Builds a small random-weight Llama (as gpu_calibrate_cuda.py does), runs the producer once on one
GPU and once as torchrun ranks, one GPU each (--dist-backend nccl), and compares the files: every
second moment and p2_weight within (documents + ranks) float64 roundings of its largest entry (the
ranks' partial sums are added in another order than one process adds its documents), everything
else (counts, ranges, reservoir rows, positions, priorities, provenance) identical — each document
runs through the same kernels on a GPU of the same kind.

With --model DIR --ids FILE it then times that model on 1 GPU and on all ranks (wall time of the
process, model load included) in --dtype.

    PYTHONPATH=python python python/tests/gpu_calibrate_nccl.py [--nproc 2] [--model M --ids I --tokens N]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from stats_compare import compare_split_run  # noqa: E402

EPS64 = 2.0 ** -53


def torchrun(nproc: int, args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           "-m", "kvcc.calibrate", *args], capture_output=True, text=True, env=env)


def compare(one: Path, many: Path, nproc: int) -> float:
    with h5py.File(one, "r") as f:
        sequences = int(f["provenance"].attrs["sequences"])
    worst, bad = compare_split_run(one, many, 2 * (sequences + nproc) * EPS64)
    assert not bad, "NCCL ranks differ from one process:\n" + "\n".join(bad[:20])
    return worst


def main() -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=0, help="ranks (default: every CUDA device)")
    p.add_argument("--model")
    p.add_argument("--ids")
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    nproc = args.nproc or torch.cuda.device_count()
    if nproc < 2:
        print(f"{torch.cuda.device_count()} CUDA device(s): NCCL needs two; nothing to check")
        return 0
    work = Path(tempfile.mkdtemp(prefix="kvcc-nccl-"))
    env = dict(os.environ, PYTHONPATH=str(HERE.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))

    cfg = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(work / "random-llama", safe_serialization=True)
    rng = np.random.default_rng(0)
    ids = work / "ids.txt"
    ids.write_text("".join(" ".join(map(str, rng.integers(3, 1024, size=int(n)))) + "\n"
                           for n in rng.integers(200, 1024, size=13)))
    common = ["--model", str(work / "random-llama"), "--ids", str(ids), "--max-seq-len", "1024", "--reservoir", "256",
              "--device", "cuda"]
    res = subprocess.run([sys.executable, "-m", "kvcc.calibrate", *common, "-o", str(work / "one.h5")],
                         capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    res = torchrun(nproc, [*common, "--dist-backend", "nccl", "-o", str(work / "many.h5")], env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{nproc} ranks (nccl)" in res.stderr, res.stderr
    worst = compare(work / "one.h5", work / "many.h5", nproc)
    print(f"{nproc} NCCL ranks vs one process: sums within {worst:.1e} of their largest entry, "
          "everything else identical")

    if args.model:
        timed = ["--model", args.model, "--ids", args.ids, "--tokens", str(args.tokens), "--max-seq-len",
                 str(args.max_seq_len), "--dtype", args.dtype, "--device", "cuda"]
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "kvcc.calibrate", *timed, "-o", str(work / "t1.h5")],
                             capture_output=True, text=True, env=env)
        one_s = time.perf_counter() - t0
        assert res.returncode == 0, res.stderr
        t0 = time.perf_counter()
        res = torchrun(nproc, [*timed, "-o", str(work / "tn.h5")], env)
        many_s = time.perf_counter() - t0
        assert res.returncode == 0, res.stdout + res.stderr
        print(f"{args.model}, {args.tokens} tokens, {args.dtype}: 1 GPU {one_s:.1f} s, {nproc} GPUs (NCCL) "
              f"{many_s:.1f} s (process wall time, model load included)")
        print(res.stderr.strip().splitlines()[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
