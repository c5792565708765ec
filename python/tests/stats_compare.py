"""Comparison of two kvcc-stats files (shared by test_calibrate.py and gpu_calibrate_cuda.py; needs
numpy and h5py only)."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

EPS32 = 2.0 ** -24  # float32 unit roundoff


def _flatten(f) -> dict:
    """path -> value for every attribute ('path@name') and dataset of an HDF5 file. The attribute
    checksums (attributes_sha256) are left out: they follow from the attributes compared, and the
    C++ readers check them whenever they read a file."""
    out = {}

    def visit(g, path):
        for k, v in g.attrs.items():
            if k == "attributes_sha256":
                continue
            out[f"{path}@{k}"] = v
        for k in g:
            x = g[k]
            if isinstance(x, h5py.Group):
                visit(x, f"{path}/{k}")
            else:
                out[f"{path}/{k}"] = (x.dtype, x[()])

    visit(f, "")
    return out


def float_tolerance(config: dict, max_seq_len: int) -> float:
    """Largest |py - c| / max|c| expected of any float array, from the effects that differ:

    - the forward pass: both run it in float32 with different summation orders; a dot product of
      length K has relative rounding error ~sqrt(K)·2^-24 (random-walk growth), and each layer's
      residual stream adds its own, so rows after n layers differ by ~n·sqrt(K)·2^-24 with K the
      longest reduction (the MLP's intermediate size);
    - RoPE: transformers forms inv_freq in float32 where kvcc rounds a float64 value, so the angle
      p·f of position p differs by up to ~2·p·2^-24 (one ulp of f, one of the product): a relative
      error of 2·max_seq_len·2^-24 in post-RoPE q and k;
    - second moments and value targets are float64 sums of products of two such rows: twice the
      row error (float64 accumulation itself adds only N·2^-53).
    """
    n, k = config["n_layers"], max(config["hidden"], config["intermediate"])
    row = (n * np.sqrt(k) + 2 * max_seq_len) * EPS32
    return 2 * row


def compare_stats(c_path: Path, py_path: Path, tol: float) -> dict:
    """Asserts equality of everything but the three provenance strings that name the producer and
    time; returns the largest scaled float difference per dataset name."""
    with h5py.File(c_path, "r") as fc, h5py.File(py_path, "r") as fp:
        a, b = _flatten(fc), _flatten(fp)
    assert sorted(a) == sorted(b), f"different objects: {sorted(set(a) ^ set(b))[:10]}"
    assert a["@format"] == b["@format"] == "kvcc-stats"
    worst: dict[str, float] = {}
    for key in sorted(a):
        if key in ("@created", "@command", "@producer"):
            continue
        x, y = a[key], b[key]
        if isinstance(x, tuple):  # dataset: dtype must match exactly (readers refuse others)
            assert x[0] == y[0], f"{key}: dtype {y[0]} vs {x[0]}"
            x, y = x[1], y[1]
        if isinstance(x, (str, bytes)):
            assert x == y, f"{key}: {y!r} vs {x!r}"
            continue
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, f"{key}: {y.dtype}{y.shape} vs {x.dtype}{x.shape}"
        if x.dtype.kind in "iub":
            assert np.array_equal(x, y), f"{key}: integers differ"
            continue
        finite = np.isfinite(x)
        assert np.array_equal(finite, np.isfinite(y)) and np.array_equal(x[~finite], y[~finite]), \
            f"{key}: non-finite entries differ"
        if not finite.any():
            continue
        scale = np.abs(x[finite]).max()
        err = np.abs(x[finite] - y[finite]).max() / (scale if scale > 0 else 1.0)
        assert err <= tol, f"{key}: max |py - c| / max |c| = {err:.3e} > {tol:.3e}"
        name = key.rsplit("/", 1)[-1].split("@")[-1]
        worst[name] = max(worst.get(name, 0.0), float(err))
    return worst


def compare_split_run(one: Path, many: Path, tol: float) -> tuple[float, list[str]]:
    """One process's file against the same run split over ranks: every second moment and p2_weight
    within `tol` of its largest entry (partial sums added in another order), everything else
    (counts, ranges, reservoir rows, positions, priorities, strings) identical. Returns the largest
    scaled sum difference and the list of disagreements (empty when they agree)."""
    with h5py.File(one, "r") as f1, h5py.File(many, "r") as f2:
        a, b = _flatten(f1), _flatten(f2)
    if sorted(a) != sorted(b):
        return 0.0, [f"different objects: {sorted(set(a) ^ set(b))[:10]}"]
    worst, bad = 0.0, []
    for key in sorted(a):
        if key in ("@created", "@command"):
            continue
        x, y = a[key], b[key]
        if isinstance(x, tuple):
            if x[0] != y[0]:
                bad.append(f"{key}: dtype {y[0]} vs {x[0]}")
                continue
            x, y = x[1], y[1]
        if isinstance(x, (str, bytes)):
            if x != y:
                bad.append(f"{key}: {y!r} vs {x!r}")
            continue
        x, y = np.asarray(x), np.asarray(y)
        if key.endswith("_m2") or key.endswith("@p2_weight"):
            err = float(np.abs(x - y).max() / max(float(np.abs(x).max()), 1e-300))
            worst = max(worst, err)
            if err > tol:
                bad.append(f"{key}: {err:.2e} > {tol:.2e}")
        elif not np.array_equal(x, y):
            bad.append(f"{key}: differs")
    return worst, bad
