#!/usr/bin/env python3
"""One-off interop check (run by hand, recorded in docs/zoo.md): the OSCAR files that
`kvcc zoo export-oscar` writes load with PyTorch's torch.load(..., weights_only=True) and hold
exactly the tensors of the OSCAR originals they were imported from.

    python3 tests/reference/check_oscar_export.py build-zoo/cli/kvcc \
        ../shared/zoo-reference/oscar/qwen3-4b-thinking-2507 /tmp/kvcc-oscar-check
"""
import os
import subprocess
import sys

import torch

K, V = "k_rotation_qqt_r_h_pbr.pt", "v_rotation_sst_r_h_pbr.pt"


def run(*args):
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)


def main(kvcc, src, work):
    os.makedirs(work, exist_ok=True)
    art = f"{work}/q.kvcc.h5"
    run(kvcc, "zoo", "import-oscar", f"{src}/{K}", f"{src}/{V}", "--model-id", "qwen3-4b-thinking-2507",
        "--n-heads", "32", "--n-kv-heads", "8", "-o", art)
    for version in (1, 2):
        out = f"{work}/v{version}"
        run(kvcc, "zoo", "export-oscar", art, "-o", out, "--format-version", str(version))
        for name in (K, V):
            orig = torch.load(f"{src}/{name}", map_location="cpu", weights_only=True)
            mine = torch.load(f"{out}/{name}", map_location="cpu", weights_only=True)
            assert mine["format_version"] == version, mine["format_version"]
            assert mine["objective"] == orig["objective"]
            assert sorted(mine["layers"]) == sorted(orig["layers"])
            for lid, entry in orig["layers"].items():
                got = mine["layers"][lid]
                assert got["layer_id"] == lid
                for field in ("rotation", "eigenvalues"):
                    want = entry[field]
                    have = got[field]
                    assert have.dtype == torch.float32
                    if version == 2:  # [n_kv_heads, ...]: every KV head holds the per-layer tensor
                        assert have.shape == (8,) + tuple(want.shape), have.shape
                        for h in range(8):
                            assert torch.equal(have[h], want), (name, lid, field, h)
                    else:
                        assert torch.equal(have, want), (name, lid, field)
            print(f"format_version {version} {name}: {len(orig['layers'])} layers equal to the original "
                  f"(torch {torch.__version__}, weights_only=True)")


if __name__ == "__main__":
    main(*sys.argv[1:4])
