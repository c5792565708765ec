"""python -m kvcc.calibrate on architectures the C++ forward does not run, and at head_dims 64 / 256 (CPU).

Tiny random models built with transformers' config classes and saved: Qwen3-MoE (4 experts, top 2,
q/k norms), Mixtral (4 experts, sliding window 16), Mistral (sliding window 16) and dense Qwen3
with `use_sliding_window` (layer 0 full, layer 1 a window of 16: windows per layer). Each is
calibrated by the producer (float32) and, independently, by running the model itself in float64
with its eager attention replaced by a float64 one that takes the model's own attention mask
(causal plus the window the model builds) and records q, k, v, the probabilities and the output;
every statistic and reservoir row is compared, to stats_compare.float_tolerance (float32 rounding
of the producer's forward). Documents are longer than the windows and the test checks that the
window changes the value targets by far more than the tolerance, so a producer that ignored it
would fail. At head_dims 64 and 256 the producer is compared with `kvcc calibrate-model`.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

h5py = pytest.importorskip("h5py")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stats_compare import compare_stats, float_tolerance  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PYTHON_DIR = REPO / "python"
CLI = Path(os.environ.get("KVCC_CLI", REPO / "build" / "cli" / "kvcc"))
MODELS = REPO / "tests" / "data" / "models"
WINDOW, DOCS, DOC_LEN, VOCAB = 16, 5, 48, 128
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, vocab_size=VOCAB, max_position_embeddings=512,
              rms_norm_eps=1e-5, tie_word_embeddings=False)


def _configs():
    t = transformers
    return {
        "qwen3-moe": (t.Qwen3MoeConfig(moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                                       decoder_sparse_step=1, **COMMON), t.Qwen3MoeForCausalLM, [None, None]),
        "mixtral-sw": (t.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW, **COMMON),
                       t.MixtralForCausalLM, [WINDOW, WINDOW]),
        "mistral-sw": (t.MistralConfig(sliding_window=WINDOW, **COMMON), t.MistralForCausalLM, [WINDOW, WINDOW]),
        "qwen3-sw": (t.Qwen3Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **COMMON),
                     t.Qwen3ForCausalLM, [None, WINDOW]),
    }


def _randomize(model, seed):
    # Fan-in scaled weights and non-unit norms (default init gives near-uniform attention).
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / p.shape[-1] ** 0.5))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    out = {}
    for i, (name, (config, cls, windows)) in enumerate(_configs().items()):
        torch.manual_seed(i)
        model = cls(config).float()
        _randomize(model, 500 + i)
        model.save_pretrained(root / name)
        out[name] = (root / name, windows)
    rng = np.random.default_rng(11)
    ids = root / "ids.txt"
    ids.write_text("\n".join(" ".join(str(int(t)) for t in rng.integers(0, VOCAB, DOC_LEN)) for _ in range(DOCS))
                   + "\n")
    return out, ids


def _run_py(*args):
    env = dict(os.environ, PYTHONPATH=str(PYTHON_DIR) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "kvcc.calibrate", *map(str, args)], capture_output=True, text=True,
                          env=env)


def _reference(model_dir: Path, docs: list[list[int]], windows):
    """Per layer and KV head the producer's sums, from the model run in float64 with its own masks;
    and per layer the rows (q, key_pre, key, value) of every token, for the reservoir."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64,
                                                              attn_implementation="eager",
                                                              experts_implementation="eager")  # no float64 grouped_mm
    model.eval()
    attn = [layer.self_attn for layer in model.model.layers]
    modeling = importlib.import_module(type(attn[0]).__module__)
    L, K = len(attn), model.config.num_key_value_heads
    H, d = model.config.num_attention_heads, COMMON["head_dim"]
    r = H // K
    z = lambda *s: np.zeros(s)  # noqa: E731
    sums = [[{"query_m2": z(d, d), "key_m2": z(d, d), "value_m2": z(d, d), "output_m2": z(d, d), "p2_m2": z(d, d),
              "p2_weight": 0.0, "nowindow_output_m2": z(d, d), "nowindow_p2_m2": z(d, d),
              "key_min": np.full(d, np.inf), "key_max": np.full(d, -np.inf),
              "value_min": np.full(d, np.inf), "value_max": np.full(d, -np.inf)} for _ in range(K)] for _ in range(L)]
    rows = [[] for _ in range(L)]  # per doc: q [T, K, r, d], key_pre, key, value [T, K, d]
    pre = {}

    def record(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        layer = module.layer_idx
        assert attention_mask is not None, "the eager path must carry the model's mask"
        q, k, v = query[0], key[0], value[0]  # [H, T, d], [K, T, d]
        T = q.shape[1]
        kr, vr = k.repeat_interleave(r, 0), v.repeat_interleave(r, 0)
        s = q @ kr.transpose(1, 2) * scaling
        p = torch.softmax(s + attention_mask[0, :, :, :T], dim=-1)  # the model's mask: causal + its window
        o = p @ vr
        causal = torch.triu(torch.full((T, T), -torch.inf, dtype=s.dtype), 1)
        p_full = torch.softmax(s + causal, dim=-1)  # the same without any window
        o_full = p_full @ vr
        # The mask the model built is the window this layer declares (or plain causal).
        i, j = np.indices((T, T))
        allowed = (j <= i) & ((i - j < windows[layer]) if windows[layer] else True)
        assert np.array_equal(np.isfinite(attention_mask[0, 0, :, :T].numpy()) &
                              (attention_mask[0, 0, :, :T].numpy() > -1e300), allowed)
        for h in range(K):
            S = sums[layer][h]
            g = slice(h * r, (h + 1) * r)
            qg = q[g].reshape(-1, d).numpy()
            S["query_m2"] += qg.T @ qg
            S["key_m2"] += k[h].numpy().T @ k[h].numpy()
            S["value_m2"] += v[h].numpy().T @ v[h].numpy()
            for side, x in (("key", k[h].numpy()), ("value", v[h].numpy())):
                S[side + "_min"] = np.minimum(S[side + "_min"], x.min(0))
                S[side + "_max"] = np.maximum(S[side + "_max"], x.max(0))
            for prefix, pp, oo in (("", p, o), ("nowindow_", p_full, o_full)):
                og = oo[g].reshape(-1, d).numpy()
                S[prefix + "output_m2"] += og.T @ og
                w = (pp[g] ** 2).sum(dim=(0, 1)).numpy()
                vw = v[h].numpy() * np.sqrt(w)[:, None]
                S[prefix + "p2_m2"] += vw.T @ vw
                if not prefix:
                    S["p2_weight"] += w.sum()
        kp = pre.pop(layer).reshape(T, K, d)
        rows[layer].append((q.permute(1, 0, 2).reshape(T, K, r, d).numpy(), kp.numpy(),
                            k.permute(1, 0, 2).numpy(), v.permute(1, 0, 2).numpy()))
        return o.transpose(0, 1).unsqueeze(0).contiguous(), p.unsqueeze(0)

    hooks = []
    for a in attn:  # the pre-RoPE key: k_proj's output, after k_norm where the model has one
        src = a.k_norm if hasattr(a, "k_norm") else a.k_proj
        hooks.append(src.register_forward_hook(lambda m, i, out, layer=a.layer_idx: pre.__setitem__(layer, out[0])))
    original = modeling.eager_attention_forward
    modeling.eager_attention_forward = record
    try:
        with torch.no_grad():
            for doc in docs:
                model(input_ids=torch.tensor([doc]), use_cache=False)
    finally:
        modeling.eager_attention_forward = original
        for hk in hooks:
            hk.remove()
    return sums, rows


@pytest.mark.parametrize("name", list(_configs()))
def test_statistics_equal_the_models_own_float64_attention(models, name, tmp_path):
    built, ids = models
    model_dir, windows = built[name]
    out = tmp_path / "stats.h5"
    res = _run_py("--model", model_dir, "--ids", ids, "--reservoir", 40, "--seed", 3, "-o", out)
    assert res.returncode == 0, res.stderr
    docs = [[int(t) for t in line.split()] for line in ids.read_text().splitlines()]
    sums, rows = _reference(model_dir, docs, windows)
    tol = float_tolerance({"n_layers": 2, "hidden": COMMON["hidden_size"],
                           "intermediate": COMMON["intermediate_size"]}, DOC_LEN)
    with h5py.File(out, "r") as f:
        assert f["model"].attrs["architecture"] == transformers.AutoConfig.from_pretrained(model_dir).model_type
        for layer in range(2):
            for h in range(2):
                g = f[f"layers/{layer}/kv{h}"]
                S = sums[layer][h]
                for key in ("query_m2", "key_m2", "value_m2", "output_m2", "p2_m2", "key_min", "key_max",
                            "value_min", "value_max"):
                    want, got = S[key], g[key][()]
                    err = np.abs(got - want).max() / np.abs(want).max()
                    assert err <= tol, f"layer {layer} kv{h} {key}: {err:.2e} > {tol:.2e}"
                assert abs(g.attrs["p2_weight"] - S["p2_weight"]) <= tol * S["p2_weight"]
                assert g.attrs["kv_count"] == DOCS * DOC_LEN
                assert g.attrs["query_count"] == g.attrs["output_count"] == DOCS * DOC_LEN * 2
                if windows[layer]:  # the window moves the value targets far beyond the tolerance
                    for key in ("output_m2", "p2_m2"):
                        moved = np.abs(S["nowindow_" + key] - S[key]).max() / np.abs(S[key]).max()
                        assert moved > 100 * tol, f"layer {layer} {key}: the window changes it by only {moved:.1e}"
                res_g = g["reservoir"]
                assert len(res_g["position"]) == 40
                for n, (doc, pos) in enumerate(zip(res_g["doc"][()], res_g["position"][()])):
                    q, kp, k, v = rows[layer][int(doc)]
                    for key, want in (("q", q[pos, h]), ("key_pre", kp[pos, h]), ("key", k[pos, h]),
                                      ("value", v[pos, h])):
                        got = res_g[key][n]
                        assert np.abs(got - want).max() <= tol * np.abs(want).max() + 1e-30, (layer, h, key, n)


@pytest.mark.parametrize("name", ["llama31-hd64", "qwen3-hd64", "llama-hd256"])
def test_head_dims_64_and_256_match_the_cpp_producer(name, tmp_path):
    if not CLI.exists():
        pytest.skip(f"the kvcc CLI is not built at {CLI}")
    model_dir = MODELS / name
    ids = tmp_path / "ids.txt"
    rng = np.random.default_rng(4)
    ids.write_text("\n".join(" ".join(str(int(t)) for t in rng.integers(3, 128, 64)) for _ in range(4)) + "\n")
    common = ["--model", model_dir, "--ids", ids, "--reservoir", 50]
    cpp, py = tmp_path / "c.h5", tmp_path / "p.h5"
    subprocess.run([str(CLI), "calibrate-model", *map(str, common), "-o", str(cpp)], check=True, capture_output=True)
    res = _run_py(*common, "-o", py)
    assert res.returncode == 0, res.stderr
    with h5py.File(cpp, "r") as f:
        cfg = {k: int(f["model"].attrs[k]) for k in ("n_layers", "hidden", "intermediate")}
        assert int(f["model"].attrs["head_dim"]) in (64, 256)
    compare_stats(cpp, py, float_tolerance(cfg, 64))
