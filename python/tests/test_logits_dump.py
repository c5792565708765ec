"""`kvcc validate --dump-logits` against transformers: the dumped full-precision logits (and top-k
log-probabilities) of every scored position equal transformers' float32 forward pass of the same
documents, within float32 rounding.

The tolerance is the one tests/test_forward.cpp holds the C++ forward pass to against transformers
(max |diff| / max |logit| < 1e-4): two float32 implementations summing in different orders, far
below what a modelling error (a wrong mask, RoPE position or norm) would give. Models: the tiny
random transformers models of tests/data/models (always present) and, when ../shared is mounted,
gutenberg-27m. Needs the kvcc CLI (KVCC_CLI, default build/cli/kvcc).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
st = pytest.importorskip("safetensors.numpy")

from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("KVCC_SHARED", REPO.parent / "shared"))
CLI = Path(os.environ.get("KVCC_CLI", REPO / "build" / "cli" / "kvcc"))
REL_TOL = 1e-4

pytestmark = pytest.mark.skipif(not CLI.is_file(), reason=f"the kvcc CLI ({CLI}; set KVCC_CLI) is absent")

MODELS = [REPO / "tests" / "data" / "models" / name for name in ("llama31-hd128", "qwen3-hd64", "qwen2-bias")]


def _documents(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, size=n)] for n in lengths]


def _dump(model: Path, docs: list[list[int]], tmp: Path, *extra: str) -> tuple[dict[str, np.ndarray], dict]:
    ids = tmp / "docs.ids"
    ids.write_text("".join(" ".join(map(str, d)) + "\n" for d in docs))
    out = tmp / "dump.safetensors"
    # One block per document: the reference run is the plain forward pass.
    cmd = [str(CLI), "validate", "--model", str(model), "--ids", str(ids), "--block", "4096",
           "--max-seq-len", "4096", "--dump-logits", str(out), *extra]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    with safe_open(str(out), framework="np") as f:
        meta = f.metadata()
    return st.load_file(str(out)), meta


def _transformers_logits(model, doc: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([doc])).logits[0].float().numpy()


def _check(model_dir: Path, docs: list[list[int]], tmp: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    full, meta = _dump(model_dir, docs, tmp)
    assert meta["format"] == "kvcc-logits" and meta["kind"] == "logits"
    assert json.loads(meta["runs"]) == ["reference"]
    assert int(meta["vocab"]) == hf.config.vocab_size
    logits = full["reference/logits"]
    assert logits.shape == (sum(len(d) - 1 for d in docs), hf.config.vocab_size)
    row = 0
    max_diff = max_ref = 0.0
    for d, doc in enumerate(docs):
        ref = _transformers_logits(hf, doc)[:-1]  # the last position scores no next token
        n = len(doc) - 1
        assert (full["document"][row:row + n] == d).all()
        assert (full["position"][row:row + n] == np.arange(n)).all()
        assert (full["target"][row:row + n] == np.asarray(doc[1:])).all()
        assert (full["tokens"][full["document_offsets"][d]:full["document_offsets"][d + 1]] == np.asarray(doc)).all()
        max_diff = max(max_diff, float(np.abs(logits[row:row + n] - ref).max()))
        max_ref = max(max_ref, float(np.abs(ref).max()))
        row += n
    assert max_ref > 0.5  # not degenerate
    assert max_diff < REL_TOL * max_ref, f"{model_dir.name}: max |diff| {max_diff} / max |logit| {max_ref}"

    # Top-k: the k largest log-probabilities, sorted; compared by value (robust to near-ties
    # swapping order) and, at the dumped ids, against transformers' own log-probabilities.
    k = 5
    top, meta = _dump(model_dir, docs, tmp, "--dump-top-k", str(k))
    assert meta["kind"] == "top_k" and meta["k"] == str(k)
    ref_lp = np.concatenate([torch.log_softmax(torch.from_numpy(_transformers_logits(hf, doc)[:-1]).double(), -1)
                             .numpy() for doc in docs])
    ids, lps = top["reference/top_ids"], top["reference/top_logprobs"]
    assert ids.shape == (row, k) and lps.shape == (row, k)
    assert (np.diff(lps, axis=1) <= 0).all()
    want = -np.sort(-ref_lp, axis=1)[:, :k]
    assert np.abs(lps - want).max() < REL_TOL * max_ref
    assert np.abs(lps - np.take_along_axis(ref_lp, ids.astype(np.int64), axis=1)).max() < REL_TOL * max_ref


@pytest.mark.parametrize("model_dir", MODELS, ids=lambda p: p.name)
def test_dumped_logits_equal_transformers_tiny(model_dir: Path, tmp_path: Path):
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    _check(model_dir, _documents(vocab, [48, 17, 2], seed=3), tmp_path)


def test_dumped_logits_equal_transformers_gutenberg(tmp_path: Path):
    model_dir = SHARED / "models" / "gutenberg-27m"
    if not (model_dir / "config.json").is_file():
        pytest.skip(f"{model_dir} is absent (../shared not mounted)")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    _check(model_dir, _documents(vocab, [300, 120], seed=5), tmp_path)
