#!/usr/bin/env python3
"""Reference values for tests/test_oscar_import.cpp, made once with PyTorch (an implementation
independent of kvcc's zip/pickle reader): for each layer of OSCAR's published Qwen3-4B-Thinking-2507
rotation files, the sha256 of the rotation and eigenvalue tensors' float32 little-endian bytes
(row-major), their shapes and a few values.

    python3 tests/reference/make_oscar_refs.py ../shared/zoo-reference/oscar/qwen3-4b-thinking-2507 \
        tests/data/oscar/qwen3-4b-thinking-2507.json
"""
import hashlib
import json
import sys

import torch


def digest(t):
    t = t.detach().to(torch.float32).contiguous()
    return hashlib.sha256(t.numpy().astype("<f4").tobytes()).hexdigest()


def main(src, out):
    refs = {"torch_version": torch.__version__, "files": {}}
    for name in ("k_rotation_qqt_r_h_pbr.pt", "v_rotation_sst_r_h_pbr.pt"):
        d = torch.load(f"{src}/{name}", map_location="cpu", weights_only=True)
        layers = {}
        for lid, entry in sorted(d["layers"].items()):
            r, ev = entry["rotation"], entry["eigenvalues"]
            eye = torch.eye(r.shape[0], dtype=torch.float64)
            layers[str(lid)] = {
                "rotation_shape": list(r.shape),
                "rotation_sha256": digest(r),
                "eigenvalues_shape": list(ev.shape),
                "eigenvalues_sha256": digest(ev),
                "rotation_00": float(r[0, 0]),
                "eigenvalue_min": float(ev.min()),
                "eigenvalue_max": float(ev.max()),
                "orthogonality_error": float((r.double().T @ r.double() - eye).abs().max()),
            }
        refs["files"][name] = {
            "format_version": d["format_version"],
            "objective": d["objective"],
            "source_grouping": d["source_grouping"],
            "layers": layers,
        }
    with open(out, "w") as f:
        json.dump(refs, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
