"""python -m kvcc.calibrate against `kvcc calibrate-model` on the real models (CPU).

Both producers run over the same text with the same options; every attribute and dataset of the two
stats files is compared (strings and integers exactly, floats to the float32-rounding tolerance
derived in `float_tolerance`), then `kvcc compile` on the Python file must succeed and give the
rotations of the C++ file to the eigen-decomposition's sensitivity.

Needs the kvcc CLI (KVCC_CLI, default build/cli/kvcc) and the model set (KVCC_SHARED, default the
`shared/` folder beside the repository); skips with a message when either is absent.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

h5py = pytest.importorskip("h5py")
pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stats_compare import compare_stats as _compare_stats, float_tolerance  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("KVCC_SHARED", REPO.parent / "shared"))
CLI = Path(os.environ.get("KVCC_CLI", REPO / "build" / "cli" / "kvcc"))
PYTHON_DIR = REPO / "python"

# (model, text, tokens, max_seq_len): small budgets keep each case well under a minute on 2 cores.
CASES = {
    "tinystories-656k": ("tinystories_valid_100.txt", 3000, 256),
    "gutenberg-27m": ("gutenberg_heldout.txt", 1536, 512),
    "gutenberg-27m-16k": ("gutenberg_heldout.txt", 1536, 512),
}
RESERVOIR = 200


def _need(path: Path, what: str):
    if not path.exists():
        pytest.skip(f"{what} not found at {path}")


def _run_cli(*args, check=True):
    return subprocess.run([str(CLI), *map(str, args)], capture_output=True, text=True, check=check)


def _run_py(*args):
    env = dict(os.environ, PYTHONPATH=str(PYTHON_DIR) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "kvcc.calibrate", *map(str, args)], capture_output=True, text=True,
                          env=env)


def _normalized_targets(path: Path):
    """(layer, head) -> {key: query_m2 / query_count, value: p2_m2 / p2_weight}: what compile decomposes."""
    out = {}
    with h5py.File(path, "r") as f:
        for l_name, lg in f["layers"].items():
            for h_name, g in lg.items():
                out[(int(l_name), int(h_name[2:]))] = {
                    "key": g["query_m2"][()] / float(g.attrs["query_count"]),
                    "value": g["p2_m2"][()] / float(g.attrs["p2_weight"]),
                }
    return out


def _check_rotations(c_stats: Path, py_stats: Path, c_art: Path, py_art: Path) -> tuple[int, int, float]:
    """Eigenvalues within Weyl's bound ||ΔM||₂ and each eigenvector within the Davis–Kahan bound
    sin θ ≤ ||ΔM||₂ / (gap - ||ΔM||₂), gap = distance to the nearest other eigenvalue (vectors whose
    bound reaches 1 are not determined by the stats and are not compared). Returns (vectors
    compared, vectors total, largest sin θ seen)."""
    mc, mp = _normalized_targets(c_stats), _normalized_targets(py_stats)
    compared = total = 0
    worst = 0.0
    with h5py.File(c_art, "r") as fc, h5py.File(py_art, "r") as fp:
        for (layer, head), targets in mc.items():
            for side in ("key", "value"):
                path = f"layers/{layer}/kv{head}/{side}"
                u_c, u_p = fc[path + "/rotation"][()], fp[path + "/rotation"][()]
                ev_c, ev_p = fc[path + "/eigenvalues"][()], fp[path + "/eigenvalues"][()]
                m = targets[side]
                dm = np.linalg.norm(mp[(layer, head)][side] - m, 2)
                slack = 1e-12 * np.linalg.norm(m, 2)  # the two float64 eigen-solvers' own rounding
                assert np.abs(np.sort(ev_p) - np.sort(ev_c)).max() <= dm + slack, f"{path}: eigenvalues move more " \
                    f"than ||ΔM||₂ = {dm:.3e}"
                d = len(ev_c)
                for i in range(d):
                    total += 1
                    others = np.delete(ev_c, i)
                    gap = np.abs(others - ev_c[i]).min() if d > 1 else np.inf
                    if gap <= 2 * (dm + slack):
                        continue
                    bound = (dm + slack) / (gap - dm - slack)
                    # Columns hold eigenvectors in the artifact's eigenvalue order (U composition).
                    j = int(np.argmin(np.abs(ev_p - ev_c[i])))
                    cos = abs(float(u_c[:, i] @ u_p[:, j]))
                    sin = float(np.sqrt(max(0.0, 1.0 - min(1.0, cos) ** 2)))
                    assert sin <= bound + 1e-7, f"{path} vector {i}: sin θ = {sin:.3e} > bound {bound:.3e}"
                    compared += 1
                    worst = max(worst, sin)
    return compared, total, worst


@pytest.fixture(scope="module")
def cli():
    _need(CLI, "the kvcc CLI (build it: ./setup.sh)")
    _need(SHARED / "models", "the model set (../shared)")
    return CLI


@pytest.mark.parametrize("model", sorted(CASES))
def test_matches_cpp_calibrate_model(cli, model, tmp_path):
    text, tokens, max_len = CASES[model]
    model_dir, data = SHARED / "models" / model, SHARED / "text" / text
    _need(model_dir, f"model {model}")
    _need(data, f"text {text}")
    common = ["--model", model_dir, "--data", data, "--tokens", tokens, "--max-seq-len", max_len,
              "--reservoir", RESERVOIR, "--seed", 7]
    c_stats, py_stats = tmp_path / "c.stats.h5", tmp_path / "py.stats.h5"
    _run_cli("calibrate-model", *common, "-o", c_stats)
    res = _run_py(*common, "-o", py_stats, "--device", "cpu")
    assert res.returncode == 0, res.stderr
    assert "tok/s" in res.stderr
    with h5py.File(py_stats, "r") as f:
        assert str(f.attrs["command"]).startswith("python -m kvcc.calibrate")

    # Token ids: the Python tokenization equals `kvcc tokenize` (checked through --ids as well).
    ids = tmp_path / "ids.txt"
    _run_cli("tokenize", "--model", model_dir, "--data", data, "-o", ids)
    sys.path.insert(0, str(PYTHON_DIR))
    try:
        from kvcc import calibrate as kc
        from kvcc._stats_h5 import read_model_config
    finally:
        sys.path.pop(0)
    config = read_model_config(str(model_dir))
    enc = kc.DocumentEncoder(str(model_dir), "", config)
    docs = kc.split_documents(data.read_text(encoding="utf-8"))
    expected = kc.read_token_id_file(str(ids))
    assert len(expected) == len(docs)
    for doc, want in zip(docs[:40], expected[:40]):
        assert enc.encode(doc) == want

    with h5py.File(c_stats, "r") as f:
        cfg = {k: int(f["model"].attrs[k]) for k in ("n_layers", "hidden", "intermediate")}
    tol = float_tolerance(cfg, max_len)
    worst = _compare_stats(c_stats, py_stats, tol)
    print(f"\n{model}: tolerance {tol:.2e}; largest |py - c| / max|c|: "
          + ", ".join(f"{k} {v:.1e}" for k, v in sorted(worst.items())))

    # compile accepts the Python stats; rotations agree to the eigen-decomposition's sensitivity.
    c_art, py_art = tmp_path / "c.kvcc.h5", tmp_path / "py.kvcc.h5"
    for stats, art in ((c_stats, c_art), (py_stats, py_art)):
        _run_cli("compile", stats, "--method", "oscar", "--composition", "U", "-o", art)
    compared, total, worst_sin = _check_rotations(c_stats, py_stats, c_art, py_art)
    assert compared >= total // 2, f"only {compared} of {total} eigenvectors are determined by the stats"
    print(f"{model}: {compared}/{total} eigenvectors within Davis–Kahan bounds, largest sin θ {worst_sin:.1e}")
    _run_cli("compile", py_stats, "--method", "oscar", "--key-bits", 2, "--value-bits", 2, "-o",
             tmp_path / "py.uhp.kvcc.h5")
    _run_cli("verify", py_stats)


def test_shards_merge_with_cpp(cli, tmp_path):
    """A Python shard merged with a C++ shard by `kvcc merge-stats` equals the single C++ run."""
    model_dir, data = SHARED / "models" / "tinystories-656k", SHARED / "text" / "tinystories_valid_100.txt"
    _need(model_dir, "model tinystories-656k")
    common = ["--model", model_dir, "--data", data, "--tokens", 2500, "--max-seq-len", 200, "--reservoir", 300]
    whole, s0, s1, merged = (tmp_path / n for n in ("whole.h5", "s0.h5", "s1.h5", "merged.h5"))
    _run_cli("calibrate-model", *common, "-o", whole)
    _run_cli("calibrate-model", *common, "--shard", "1/2", "-o", s1)
    res = _run_py(*common, "--shard", "0/2", "-o", s0)
    assert res.returncode == 0, res.stderr
    _run_cli("merge-stats", s0, s1, "-o", merged)
    with h5py.File(whole, "r") as f:
        cfg = {k: int(f["model"].attrs[k]) for k in ("n_layers", "hidden", "intermediate")}
    with h5py.File(merged, "r") as fm, h5py.File(whole, "r") as fw:
        # merge-stats rewrites data_sha256 as "merged:..." by design; everything else must agree.
        assert fm["provenance"].attrs["data_sha256"].startswith("merged:")
    tmp = tmp_path / "merged-fixed.h5"
    shutil.copy(merged, tmp)
    with h5py.File(tmp, "r+") as f, h5py.File(whole, "r") as fw:
        f["provenance"].attrs["data_sha256"] = fw["provenance"].attrs["data_sha256"]
    _compare_stats(whole, tmp, float_tolerance(cfg, 200))


def test_refuses_bad_input(cli, tmp_path):
    model_dir, data = SHARED / "models" / "tinystories-656k", SHARED / "text" / "tinystories_valid_100.txt"
    _need(model_dir, "model tinystories-656k")
    out = tmp_path / "s.h5"

    def refused(*args, expect: str, code: int = 1):
        res = _run_py(*args)
        assert res.returncode == code, res.stderr
        assert expect in res.stderr, res.stderr
        assert not out.exists()

    refused("--model", tmp_path / "nope", "--data", data, "-o", out, expect="does not exist")
    refused("--model", model_dir, "--data", tmp_path / "none.txt", "-o", out, expect="does not exist")
    refused("--model", model_dir, "--data", data, "-o", data, expect="is the input")
    refused("--model", model_dir, "--data", data, "-o", tmp_path / "missing" / "s.h5", expect="does not exist")
    refused("--model", model_dir, "--data", data, "--tokens", "-5", "-o", out, expect="--tokens", code=2)
    refused("--model", model_dir, "--data", data, "--reservoir", "0", "-o", out, expect="--reservoir", code=2)
    refused("--model", model_dir, "--data", data, "--shard", "2/2", "-o", out, expect="--shard")
    refused("--model", model_dir, "--data", data, "--max-seq-len", "100000", "-o", out,
            expect="exceeds the model's maximum position")
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n<|endoftext|>\n \n")
    refused("--model", model_dir, "--data", empty, "-o", out, expect="holds no documents")

    # A NaN weight is refused, naming the tensor (same files, one value poisoned).
    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "nan-model"
    shutil.copytree(model_dir, bad)
    os.chmod(bad, 0o755)
    for p in bad.iterdir():
        os.chmod(p, 0o644)
    tensors = load_file(str(bad / "model.safetensors"))
    name = sorted(k for k in tensors if "k_proj" in k)[0]
    tensors[name] = tensors[name].copy()
    tensors[name].flat[3] = np.nan
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    refused("--model", bad, "--data", data, "--tokens", 100, "-o", out, expect=f"tensor {name}")
    assert not any(p.name.startswith("s.h5.tmp-") for p in tmp_path.iterdir()), "temporary file left behind"


P2_INTERPRETED = r"""
import sys
import torch
sys.path.insert(0, {python!r})
from kvcc._p2_triton import p2_column_weights
torch.manual_seed(0)
for K, r, T, d in ((2, 2, 150, 16), (1, 3, 64, 32), (3, 1, 1, 16)):
    q = torch.randn(K * r, T, d) * 2.0
    k = torch.randn(K, T, d)
    scale = d ** -0.5
    # Reference in float64: the causal softmax of each head, its squared probabilities by column.
    s = (q.double() @ k.double().repeat_interleave(r, dim=0).transpose(1, 2)) * scale
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    want = (torch.softmax(s, dim=-1) ** 2).sum(dim=1).view(K, r, T).sum(dim=1)
    got = p2_column_weights(q, k, lse.float(), scale, r)
    # Every term is positive, so the sum's relative error is at most the terms': p = exp(s - lse)
    # with a float32 score (d products: ~d·max|s|·2^-24 absolute) and lse rounded to float32
    # (max|lse|·2^-24), squared (twice that), plus the float32 sum of a 64-row block (64·2^-24).
    smax, lmax = float(s[s.isfinite()].abs().max()), float(lse.abs().max())
    bound = 4 * (2 * (d * smax + lmax) + 64) * 2.0 ** -24
    err = ((got - want).abs() / want.abs().clamp_min(1e-300)).max().item()
    assert got.dtype == torch.float64 and got.shape == (K, T), got.shape
    assert err < bound, (K, r, T, d, err, bound)
    print(K, r, T, d, f"{{err:.1e}}")
"""


def test_p2_column_weights_kernel_under_the_triton_interpreter(tmp_path):
    """The BF16/FP16 GPU path's Triton kernel (kvcc._p2_triton), run by Triton's CPU interpreter on
    float32 inputs against the float64 softmax: column sums of squared causal probabilities, for
    GQA groups, T not a multiple of the 64-row blocks, and T = 1."""
    pytest.importorskip("triton")
    script = tmp_path / "p2.py"
    script.write_text(P2_INTERPRETED.format(python=str(PYTHON_DIR)))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=dict(os.environ, TRITON_INTERPRET="1"), timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert len(res.stdout.split("\n")) >= 3, res.stdout
