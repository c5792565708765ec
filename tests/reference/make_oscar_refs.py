#!/usr/bin/env python3
"""Reference values for tests/test_oscar_import.cpp, made once with PyTorch (an implementation
independent of kvcc's zip/pickle reader): for each layer of OSCAR's published Qwen3-4B-Thinking-2507
rotation files, the sha256 of the rotation and eigenvalue tensors' float32 little-endian bytes
(row-major), their shapes and a few values.

    python3 tests/reference/make_oscar_refs.py ../shared/zoo-reference/oscar/qwen3-4b-thinking-2507 \
        tests/data/oscar/qwen3-4b-thinking-2507.json
    python3 tests/reference/make_oscar_refs.py - - --small tests/data/oscar   # small fixtures
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


if __name__ == "__main__" and len(sys.argv) == 3:
    main(sys.argv[1], sys.argv[2])


def make_small_fixtures(out_dir):
    """Small torch.save files for tests/test_oscar_pt.cpp: a strided/offset tensor archive and a
    per-KV-head (format_version 2) rotation file, with their expected digests."""
    torch.manual_seed(0)
    base = torch.arange(10, dtype=torch.float32)
    torch.save({"t": torch.arange(6, dtype=torch.float32).reshape(2, 3).t(), "view": base[3:7],
                "expanded": torch.arange(3, dtype=torch.float32).expand(2, 3), "n": 7, "f": 0.25,
                "s": "x", "l": [1, -2, 2 ** 40], "tup": (True, None)}, f"{out_dir}/strided.pt")
    layers = {}
    digests = {}
    for lid in range(2):
        q, _ = torch.linalg.qr(torch.randn(2, 4, 4, dtype=torch.float64))
        ev, _ = torch.sort(torch.rand(2, 4, dtype=torch.float64), dim=-1)
        layers[lid] = {"layer_id": lid, "rotation": q.float(), "eigenvalues": ev.float()}
        digests[str(lid)] = {"rotation_sha256": digest(q.float()), "eigenvalues_sha256": digest(ev.float())}
    torch.save({"format_version": 2, "objective": "qqt_r_h_pbr", "source_grouping": "kv_head", "layers": layers},
               f"{out_dir}/tiny_v2_k.pt")
    with open(f"{out_dir}/tiny_v2_k.json", "w") as f:
        json.dump(digests, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__" and len(sys.argv) > 3 and sys.argv[3] == "--small":
    make_small_fixtures(sys.argv[4])
