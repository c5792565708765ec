"""FP8 checkpoints through `python -m kvcc.calibrate` (CPU).

The three tiny FP8 models of tests/data/models (tests/reference/make_quantized_models.py: fp8
block scales, compressed-tensors per channel and per tensor) are dequantized by kvcc; checked:
the weights transformers ends up with against an independent dequantization in this file (the
scale grid indexed per element, not expanded by blocks) and against the generator's digests of
torch's own `w.float() * scale`; statistics of the FP8 model against the same model saved in F32
with those weights (identical float32 weights, so identical statistics); against the C++
`kvcc calibrate-model` of the FP8 model (float32 rounding, stats_compare.float_tolerance); and
the refusals, by name, of malformed and unsupported checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

h5py = pytest.importorskip("h5py")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stats_compare import _flatten, compare_stats, float_tolerance  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "tests" / "data" / "models"
CLI = Path(os.environ.get("KVCC_CLI", REPO / "build" / "cli" / "kvcc"))
PYTHON_DIR = REPO / "python"
sys.path.insert(0, str(PYTHON_DIR))
from kvcc import calibrate as kc  # noqa: E402
from kvcc._stats_h5 import KvccError, read_model_config  # noqa: E402

QUANTIZED = ["llama-fp8-block", "qwen3-ct-channel", "llama-ct-tensor"]
BLOCKS = {"llama-fp8-block": "block", "qwen3-ct-channel": "channel", "llama-ct-tensor": "tensor"}


def _run_py(*args):
    env = dict(os.environ, PYTHONPATH=str(PYTHON_DIR) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "kvcc.calibrate", *map(str, args)], capture_output=True, text=True,
                          env=env)


def _reference_dequantization(codes, scale, strategy):
    """Element (i, j) times scale[i // br, j // bc], the grid indexed per element."""
    rows, cols = codes.shape
    br, bc = {"block": (128, 128), "channel": (1, cols), "tensor": (rows, cols)}[strategy]
    grid = scale.float().reshape(-(-rows // br), -(-cols // bc))
    r = torch.arange(rows) // br
    c = torch.arange(cols) // bc
    return codes.float() * grid[r[:, None], c[None, :]]


def _write_ids(path: Path, vocab: int, docs=6, length=40, seed=3):
    rng = np.random.default_rng(seed)
    path.write_text("\n".join(" ".join(str(int(i)) for i in rng.integers(0, vocab, length)) for _ in range(docs))
                    + "\n")


def _f32_twin(src: Path, dst: Path, strategy: str):
    """The model with every quantized weight replaced by its reference dequantization, in F32."""
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    tensors = safetensors_torch.load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith(("_scale", "_scale_inv")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            suffix = "_scale_inv" if strategy == "block" else "_scale"
            out[name] = _reference_dequantization(t, tensors[name + suffix], strategy)
        else:
            out[name] = t.float()
    safetensors_torch.save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("name", QUANTIZED)
def test_dequantized_weights_equal_the_references(name):
    model_dir = MODELS / name
    config = read_model_config(str(model_dir))
    kc._register_attention()
    model = kc.load_model(str(model_dir), config, "cpu", "float32")
    params = dict(model.named_parameters())
    tensors = safetensors_torch.load_file(str(model_dir / "model.safetensors"))
    digests = json.loads((model_dir / "dequantized.json").read_text())["dequantized_f32_sha256"]
    quantized = [n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn]
    assert sorted(quantized) == sorted(digests)
    for n in quantized:
        suffix = "_scale_inv" if BLOCKS[name] == "block" else "_scale"
        want = _reference_dequantization(tensors[n], tensors[n + suffix], BLOCKS[name])
        got = params[n].detach()
        assert got.dtype == torch.float32
        assert torch.equal(got, want), n  # one float32 product per element on both sides
        assert hashlib.sha256(got.numpy().astype("<f4").tobytes()).hexdigest() == digests[n], n
    for n, t in tensors.items():  # the BF16 tensors (embeddings, norms) load unchanged
        if t.dtype == torch.bfloat16 and not n.endswith("_scale"):
            assert torch.equal(params[n].detach(), t.float()), n


@pytest.mark.parametrize("name", QUANTIZED)
def test_statistics_equal_the_f32_twin_and_the_cpp_producer(name, tmp_path):
    model_dir = MODELS / name
    vocab = read_model_config(str(model_dir)).vocab
    ids = tmp_path / "ids.txt"
    _write_ids(ids, vocab)
    twin = tmp_path / "twin"
    _f32_twin(model_dir, twin, BLOCKS[name])
    common = ["--ids", ids, "--reservoir", 50, "--seed", 5]
    fp8, f32 = tmp_path / "fp8.h5", tmp_path / "f32.h5"
    for model, out in ((model_dir, fp8), (twin, f32)):
        res = _run_py("--model", model, *common, "-o", out)
        assert res.returncode == 0, res.stderr
    # Identical float32 weights through the same forward: every statistic equal, bit for bit; only
    # the fingerprint (the weights' dtypes) differs.
    with h5py.File(fp8, "r") as fa, h5py.File(f32, "r") as fb:
        a, b = _flatten(fa), _flatten(fb)
    assert sorted(a) == sorted(b)
    differ = set()
    for key in a:
        if key in ("@created", "@command", "@producer"):
            continue
        x, y = a[key], b[key]
        x, y = (x[1], y[1]) if isinstance(x, tuple) else (x, y)
        if not np.array_equal(np.asarray(x), np.asarray(y)):
            differ.add(key)
    assert differ == {"/model/fingerprint@id", "/model/fingerprint@weights_sha256"}, sorted(differ)

    if not CLI.exists():
        pytest.skip(f"the kvcc CLI is not built at {CLI}")
    cpp = tmp_path / "cpp.h5"
    res = subprocess.run([str(CLI), "calibrate-model", "--model", str(model_dir), *map(str, common), "-o", str(cpp)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    with h5py.File(cpp, "r") as f:
        cfg = {k: int(f["model"].attrs[k]) for k in ("n_layers", "hidden", "intermediate")}
        max_len = int(f["provenance"].attrs["max_seq_len"])
    compare_stats(cpp, fp8, float_tolerance(cfg, max_len))  # the fingerprints agree too


def _copy(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(MODELS / name, dst)
    return dst


def _edit_header(path: Path, edit):
    """Rewrites a safetensors file's JSON header (the data bytes stay)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    data = bytearray(raw[8 + n:])
    edit(header, data)
    h = json.dumps(header).encode()
    path.write_bytes(len(h).to_bytes(8, "little") + h + bytes(data))


def test_refusals_name_the_cause(tmp_path):
    ids = tmp_path / "ids.txt"
    _write_ids(ids, 64, docs=1, length=8)
    out = tmp_path / "s.h5"

    def refused(model, expect):
        res = _run_py("--model", model, "--ids", ids, "-o", out)
        assert res.returncode == 1, res.stderr
        assert expect in res.stderr, res.stderr
        assert not out.exists()

    weight = "model.layers.1.self_attn.k_proj.weight"
    scale = weight + "_scale_inv"

    m = _copy("llama-fp8-block", tmp_path / "a")
    config = json.loads((m / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "awq"
    (m / "config.json").write_text(json.dumps(config))
    refused(m, "quant_method 'awq' is not supported")

    m = _copy("llama-fp8-block", tmp_path / "b")
    # Renamed rather than dropped: the safetensors library refuses a header with a hole in the data.
    _edit_header(m / "model.safetensors", lambda h, d: h.__setitem__("unused", h.pop(scale)))
    refused(m, f"tensor {weight} is F8_E4M3 but its scale {scale} is missing")

    m = _copy("llama-fp8-block", tmp_path / "c")
    _edit_header(m / "model.safetensors", lambda h, d: h[scale].update(shape=[2, 1]))
    refused(m, f"scale {scale} has shape [2, 1] but fp8 block 128x128 scales of a [72, 160] weight have shape [1, 2]")

    def nan_scale(h, d):
        start = h[scale]["data_offsets"][0]
        d[start + 4:start + 8] = np.array([np.nan], "<f4").tobytes()

    m = _copy("llama-fp8-block", tmp_path / "d")
    _edit_header(m / "model.safetensors", nan_scale)
    refused(m, f"scale {scale} holds nan at element 1 (scales must be finite and non-negative)")

    m = _copy("qwen3-ct-channel", tmp_path / "e")
    config = json.loads((m / "config.json").read_text())
    config["quantization_config"]["format"] = "pack-quantized"
    (m / "config.json").write_text(json.dumps(config))
    refused(m, "compressed-tensors format 'pack-quantized' is not supported")

    m = _copy("llama-fp8-block", tmp_path / "f")
    config = json.loads((m / "config.json").read_text())
    del config["quantization_config"]
    (m / "config.json").write_text(json.dumps(config))
    refused(m, "is F8_E4M3 but config.json has no quantization_config")


def test_parser_refuses_unsupported_schemes():
    from kvcc._quantized import parse_weight_quantization

    base = json.loads((MODELS / "qwen3-ct-channel" / "config.json").read_text())

    def refused(edit, expect):
        c = json.loads(json.dumps(base))
        edit(c["quantization_config"])
        with pytest.raises(KvccError, match=expect):
            parse_weight_quantization(c, "config.json")

    w = lambda q: q["config_groups"]["group_0"]["weights"]  # noqa: E731
    refused(lambda q: q.update(quantization_status="frozen"), "quantization_status 'frozen'")
    refused(lambda q: w(q).update(num_bits=4), "num_bits must be 8")
    refused(lambda q: w(q).update(type="int"), 'type must be "float"')
    refused(lambda q: w(q).update(symmetric=False), "asymmetric weights")
    refused(lambda q: w(q).update(strategy="token"), "strategy 'token' is not supported")
    refused(lambda q: w(q).update(strategy="group"), "strategy group lacks 'group_size'")
    refused(lambda q: q.update(quant_method="gptq"), "quant_method 'gptq' is not supported")
    refused(lambda q: q.update(quant_method="fp8", fmt="e5m2"), "fp8 fmt 'e5m2'")
    refused(lambda q: q.update(quant_method="fp8", scale_fmt="ue8m0"), "scale_fmt 'ue8m0'")
    refused(lambda q: q.update(quant_method="fp8", weight_block_size=[0, 128]), r"weight_block_size'\[0\]")
    q = parse_weight_quantization({"quantization_config": {"quant_method": "fp8"}}, "c")
    assert (q.strategy, q.block_rows, q.block_cols) == ("block", 128, 128)  # transformers' default
    q = parse_weight_quantization({"quantization_config": {"quant_method": "fp8", "weight_block_size": None}}, "c")
    assert q.strategy == "tensor"
