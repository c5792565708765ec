"""python -m kvcc.calibrate under torchrun (torch.distributed, gloo on the CPU).

Two ranks against one process over the same tokens (documents truncated by --max-seq-len and the
last one by --tokens): everything in the two stats files equal (integers, ranges, strings, every
reservoir row bit for bit: each rank runs the same per-document forward at one thread, the rows
are chosen from all documents' priorities), the sums and p2_weight to float64 reassociation of the
ranks' partial sums. The ranks' agreement on a failure, and the refusals. NCCL (the GPU backend,
the same code with device tensors) needs GPUs and is not run here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

h5py = pytest.importorskip("h5py")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
if not torch.distributed.is_available():
    pytest.skip("this torch build has no torch.distributed", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stats_compare import compare_split_run  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PYTHON_DIR = REPO / "python"
MODEL = REPO / "tests" / "data" / "models" / "llama31-hd64"
EPS64 = 2.0 ** -53


def _env():
    # One thread per process in both runs, so every document's forward is the same float32 work.
    return dict(os.environ, PYTHONPATH=str(PYTHON_DIR) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                OMP_NUM_THREADS="1")


def _torchrun(*args, nproc=2):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           *map(str, args)], capture_output=True, text=True, env=_env(), timeout=600)


def _ids(path: Path, docs=7, length=48):
    rng = np.random.default_rng(9)
    path.write_text("\n".join(" ".join(str(int(t)) for t in rng.integers(3, 128, length)) for _ in range(docs)) + "\n")


def test_two_gloo_ranks_equal_one_process(tmp_path):
    ids = tmp_path / "ids.txt"
    _ids(ids)
    common = ["--model", MODEL, "--ids", ids, "--max-seq-len", 40, "--tokens", 250, "--reservoir", 60, "--seed", 2]
    one, two = tmp_path / "one.h5", tmp_path / "two.h5"
    res = subprocess.run([sys.executable, "-m", "kvcc.calibrate", *map(str, common), "-o", str(one)],
                         capture_output=True, text=True, env=_env())
    assert res.returncode == 0, res.stderr
    res = _torchrun("-m", "kvcc.calibrate", *common, "-o", two)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "2 ranks (gloo)" in res.stderr
    assert res.stdout.count("wrote") == 1  # rank 0 alone writes
    with h5py.File(one, "r") as f1:
        sequences = int(f1["provenance"].attrs["sequences"])
    # Each sum is the two ranks' partial sums added in another order than one process adds its
    # documents: at most (documents + ranks) float64 roundings of terms bounded by the diagonal
    # (the largest entry of a second moment), so that many units in the last place of max |x|.
    _, bad = compare_split_run(one, two, 2 * (sequences + 2) * EPS64)
    assert not bad, "\n".join(bad[:20])
    with h5py.File(two, "r") as f:
        assert int(f["provenance"].attrs["tokens"]) == 250
        assert len(f["layers/0/kv0/reservoir/position"]) == 60


AGREE = """
import os, sys
sys.path.insert(0, {python!r})
from kvcc.calibrate import _Distributed
job = _Distributed("gloo", "cpu")
failing = int(os.environ["RANK"]) == 1
print(f"rank {{job.rank}}: none {{job.any_failed(False, 'cpu')}} one {{job.any_failed(failing, 'cpu')}}")
job.close()
"""


def test_ranks_agree_when_one_fails(tmp_path):
    """Every rank learns that rank 1 failed (so none waits in a collective it will not join)."""
    script = tmp_path / "agree.py"
    script.write_text(AGREE.format(python=str(PYTHON_DIR)))
    res = _torchrun(script)
    assert res.returncode == 0, res.stderr
    for rank in (0, 1):
        assert f"rank {rank}: none False one True" in res.stdout, res.stdout


def test_refusals_under_torchrun(tmp_path):
    ids = tmp_path / "ids.txt"
    _ids(ids, docs=2, length=8)
    out = tmp_path / "s.h5"
    res = _torchrun("-m", "kvcc.calibrate", "--model", MODEL, "--ids", ids, "--shard", "0/2", "-o", out)
    assert res.returncode != 0
    assert "--shard under torchrun" in res.stderr
    res = _torchrun("-m", "kvcc.calibrate", "--model", MODEL, "--ids", ids, "--dist-backend", "nccl", "-o", out)
    assert res.returncode != 0
    assert "--dist-backend nccl needs --device cuda" in res.stderr
    assert not out.exists()
