"""kvcc.hf: transformers models attending through the INT2 runtime cache (CPU reference kernels).

Real model: gutenberg-27m (../shared/models) with its published oscar artifact (sink 64, recent
256, page 64). Tests skip with a message when ../shared is absent; the comparison with the C++
`kvcc validate` also needs the CLI (build/cli/kvcc, or KVCC_CLI).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvcc  # noqa: E402
import kvcc.hf as khf  # noqa: E402
import kvcc_reference as kref  # noqa: E402
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("KVCC_SHARED", REPO.parent / "shared"))
MODEL = SHARED / "models" / "gutenberg-27m"
TEXT = SHARED / "text" / "gutenberg_heldout.txt"
TINY = SHARED / "models" / "tinystories-656k"


def _zoo_artifact(model: str, method: str = "oscar") -> str:
    found = sorted(glob.glob(str(REPO / "zoo" / "published" / model / f"{method}-*" / "artifact.*.kvcc.h5")))
    if not found:
        pytest.skip(f"no published {method} artifact for {model} in zoo/published")
    return found[0]


pytestmark = pytest.mark.skipif(not (MODEL / "config.json").is_file() or not TEXT.is_file(),
                                reason=f"the real model and text ({MODEL}, {TEXT}) are absent")


@pytest.fixture(scope="module")
def artifact() -> str:
    return _zoo_artifact("gutenberg-27m")


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    tok = AutoTokenizer.from_pretrained(MODEL)
    with open(TEXT, encoding="utf-8") as f:
        text = f.read(40000)
    return tok(text).input_ids


@pytest.fixture(scope="module")
def ref_model():
    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def kv_model(artifact):
    return khf.from_pretrained(MODEL, artifact=artifact)


def _kvcc_logits(model, artifact, ids: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """Logits of ids [B, n] through a fresh KvccCache, fed in blocks of `block` tokens (one forward
    step each; None: one step)."""
    cache = khf.KvccCache.for_model(model, artifact, max_tokens=ids.shape[1])
    block = block or ids.shape[1]
    out = []
    with torch.no_grad():
        for b0 in range(0, ids.shape[1], block):
            out.append(model(ids[:, b0:b0 + block], **khf.cache_kwargs(model, cache)).logits)
    return torch.cat(out, dim=1)


# --- (a) full-coverage windows: the kvcc path is SDPA over BF16-rounded rotated K/V ------------------


def _rotations(path: str):
    h5py = pytest.importorskip("h5py", reason="h5py reads the artifact's rotations for the emulation")
    with h5py.File(path, "r") as f:
        n_layers = len(f["layers"])
        n_kv = len([k for k in f["layers/0"] if k.startswith("kv")])
        rk = [[torch.from_numpy(f[f"layers/{l}/kv{h}/key/rotation"][()]) for h in range(n_kv)] for l in range(n_layers)]
        rv = [[torch.from_numpy(f[f"layers/{l}/kv{h}/value/rotation"][()]) for h in range(n_kv)]
              for l in range(n_layers)]
    return rk, rv


def _bf16_in_basis(x: torch.Tensor, rots) -> torch.Tensor:
    """x [B, n_kv, T, d] -> per head bf16(x·R)·Rᵀ, x·R as the runtime stores it (the rotation in
    float32, kvcc_reference.rotate_round): the rows its BF16 windows hold, in the model's basis."""
    out = torch.empty_like(x)
    for h, r in enumerate(rots):
        if r.numel() == 0:
            y = x[:, h].double().to(torch.bfloat16).double()
        else:
            y = kref.rotate_round(x[:, h].float(), r.float()).double() @ r.T
        out[:, h] = y.to(x.dtype)
    return out


@pytest.fixture(scope="module")
def bf16_windows(artifact, tokens, ref_model):
    """Logits of a text that fits the BF16 windows, by SDPA and by SDPA over K/V rounded as the
    windows hold them; (ids, sdpa logits, emulated logits, max |emulated - sdpa|)."""
    info = kvcc.load_artifact(artifact)
    n = info.sink + info.recent - 20  # every token stays in the BF16 sink and ring: no INT2 page
    ids = torch.tensor([tokens[:n]])
    rk, rv = _rotations(artifact)

    def emulated(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layer = module.layer_idx
        k = _bf16_in_basis(key, rk[layer])
        v = _bf16_in_basis(value, rv[layer])
        groups = query.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("kvcc_test_bf16_windows", emulated)
    emu_model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32,
                                                     attn_implementation="kvcc_test_bf16_windows").eval()
    with torch.no_grad():
        ref = ref_model(ids, use_cache=False).logits
        emu = emu_model(ids, use_cache=False).logits
    rounding = (emu - ref).abs().max().item()  # what BF16 windows alone do to the logits
    assert rounding > 0
    return ids, ref, emu, rounding


def test_runtime_window_attention_equals_bf16_emulation(artifact):
    """One attention op of the runtime (prefill over BF16 windows) against SDPA in float64 over
    K/V rounded as the emulation rounds them: the op-level check behind the model-level one."""
    info = kvcc.load_artifact(artifact)
    rk, rv = _rotations(artifact)
    rt = kvcc.Runtime(artifact, max_pages=4, max_sequences=1)
    seq = rt.add_sequence()
    T, H, n_kv, d = 96, info.n_heads, info.n_kv_heads, info.head_dim
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(T, H, d, generator=gen) * 2, torch.randn(T, n_kv, d, generator=gen) * 2
    v = torch.randn(T, n_kv, d, generator=gen)
    causal = torch.triu(torch.full((T, T), float("-inf"), dtype=torch.float64), 1)
    for layer in range(info.n_layers):
        out = rt.prefill(layer, seq, q, k, v).double()  # before begin_append: an empty cache plus the block

        def attend(round_kv: bool) -> torch.Tensor:
            o = torch.empty(T, H, d, dtype=torch.float64)
            for h in range(n_kv):
                kk, vv = k[:, h].double() @ rk[layer][h], v[:, h].double() @ rv[layer][h]
                if round_kv:  # as the runtime stores them: kvcc_reference.rotate_round
                    kk = kref.rotate_round(k[:, h], rk[layer][h].float()).double()
                    vv = kref.rotate_round(v[:, h], rv[layer][h].float()).double()
                kk, vv = kk @ rk[layer][h].T, vv @ rv[layer][h].T
                for g in range(H // n_kv):
                    s = q[:, h * (H // n_kv) + g].double() @ kk.T / d**0.5 + causal
                    o[:, h * (H // n_kv) + g] = torch.softmax(s, -1) @ vv
            return o

        emu, exact = attend(True), attend(False)
        rounding = (emu - exact).abs().max().item()
        # The emulation stores K/V as the runtime does (the same BF16 values), so what is left is
        # the runtime's float32 attention against float64: relative ~2^-24·sqrt(T) ≈ 1e-6 of an
        # output, against a rounding effect of ~2^-9 of one: ~1e-4 of it. 0.1% bounds that; a
        # float64 rotation in the emulation (one BF16 ulp apart in a few elements per thousand)
        # gave up to 19%, no rounding ~100%.
        ratio = (out - emu).abs().max().item() / rounding
        print(f"layer {layer}: runtime vs emulation {ratio:.3%} of the rounding effect {rounding:.3g}")
        assert ratio <= 1e-3, f"layer {layer}"


def test_full_window_logits_equal_sdpa_to_bf16_kv_rounding(artifact, kv_model, bf16_windows):
    ids, ref, emu, rounding = bf16_windows
    kv = _kvcc_logits(kv_model, artifact, ids)
    print(f"max |logit| difference: BF16-window emulation vs SDPA {rounding:.4g}, kvcc vs emulation "
          f"{(kv - emu).abs().max().item():.4g}, kvcc vs SDPA {(kv - ref).abs().max().item():.4g}")
    # Through the model, the kvcc run and the emulation round different hidden states once any
    # earlier layer differs (BF16 rounding is discontinuous), so they are two realisations of the
    # same rounding process rather than one: kvcc's deviation from SDPA must be of the size of the
    # emulation's (2x covers the spread of a maximum over ~10^6 logits; the RMS is steadier).
    assert (kv - ref).abs().max().item() <= 2.0 * rounding
    rms = lambda x: x.double().pow(2).mean().sqrt().item()  # noqa: E731
    assert rms(kv - ref) <= 1.5 * rms(emu - ref)
    # Every position's argmax agrees with SDPA's except where SDPA's top two are within 2 x 2x that.
    top2 = ref[0].topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 4.0 * rounding
    assert torch.equal(kv[0].argmax(-1)[clear], ref[0].argmax(-1)[clear])


# --- (b) per-token log-probabilities against `kvcc validate --cache runtime` --------------------------


def _cli() -> str:
    cli = os.environ.get("KVCC_CLI") or str(REPO / "build" / "cli" / "kvcc")
    if not (os.path.isfile(cli) and os.access(cli, os.X_OK)):
        pytest.skip(f"the kvcc CLI ({cli}) is absent: build it or set KVCC_CLI")
    return cli


def _log_softmax64(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), dim=-1)


def test_block_logprobs_match_cpp_validate_runtime(artifact, tokens, ref_model, kv_model, tmp_path):
    cli = _cli()
    # Two documents of 640 tokens (BOS + text): past the 320 window tokens, so ~4 INT2 pages of
    # 64 tokens per layer and head are quantised and read. The same ids go to validate (--ids), so
    # no tokenizer difference enters.
    bos, body, n = tokens[0], tokens[1:], 640
    docs = [[bos] + body[i * (n - 1):(i + 1) * (n - 1)] for i in range(2)]
    ids_file = tmp_path / "heldout.ids"
    ids_file.write_text("".join(" ".join(map(str, d)) + "\n" for d in docs))
    out = tmp_path / "validate.json"
    block = 128
    subprocess.run([cli, "validate", "--model", str(MODEL), "-a", artifact, "--ids", str(ids_file), "--cache",
                    "runtime", "--device", "cpu", "--block", str(block), "--json", str(out)], check=True,
                   capture_output=True, text=True)
    cpp = json.loads(out.read_text())
    assert cpp["mode"] == "pseudo-decode" and cpp["block"] == block and cpp["doc_lengths"] == [n, n]
    scheme = cpp["schemes"][0]
    assert scheme["cache"] == "runtime/cpu"

    # validate's protocol (eval/experiment.cpp): per document, blocks of `block` tokens; each block's
    # queries attend to the cache of earlier blocks as stored plus the block's own K/V causally
    # (Runtime::prefill), then the block is appended; every position with a next token is scored:
    # NLL of the next token, KL(full ‖ quantised) of the next-token distributions against the
    # full-precision run, top-1 agreement; means over the document's predictions.
    for d, doc in enumerate(docs):
        ids = torch.tensor([doc])
        with torch.no_grad():
            lp_ref = _log_softmax64(ref_model(ids, use_cache=False).logits[0, :-1])
        lp_q = _log_softmax64(_kvcc_logits(kv_model, artifact, ids, block=block)[0, :-1])
        target = ids[0, 1:]
        nll_ref = -lp_ref.gather(1, target[:, None]).mean().item()
        nll_q = -lp_q.gather(1, target[:, None]).mean().item()
        kl = (lp_ref.exp() * (lp_ref - lp_q)).sum(-1).clamp_min(0).mean().item()
        top1 = (lp_ref.argmax(-1) == lp_q.argmax(-1)).double().mean().item()
        c = scheme["per_document"][d]
        c_ref = cpp["reference"]["per_document_nll"][d]
        print(f"doc {d}: NLL ref {nll_ref:.6f} (C++ {c_ref:.6f}), kvcc {nll_q:.6f} (C++ {c['nll']:.6f}); "
              f"KL {kl:.4e} (C++ {c['kl']:.4e}); top-1 {top1:.4f} (C++ {c['top1_agreement']:.4f})")
        # The C++ forward equals transformers' to float32 rounding (~1e-6 relative on logits of
        # magnitude <= ~30): a mean log-probability then agrees to ~1e-4 nats at worst.
        assert abs(nll_ref - c_ref) <= 1e-4
        # The same runtime code quantises K/V that differ by float32 rounding, so a few elements
        # land on the other side of a code or BF16 boundary (probability ~1e-6 per INT2 element,
        # ~2e-4 per BF16 element, each a one-step change): their error energy is ~1e-5 of the
        # quantisation error's, so KL and ΔNLL move by ~sqrt(1e-5) ≈ 0.3% (cross term). 5% of
        # the effect, plus the 1e-4 float floor on NLL, bounds that with margin.
        assert abs(nll_q - c["nll"]) <= 0.05 * abs(c["nll"] - c_ref) + 1e-4
        assert abs(kl - c["kl"]) <= 0.05 * c["kl"] + 1e-7
        # One position in ~500 may flip its argmax where the top two are near-tied.
        assert abs(top1 - c["top1_agreement"]) <= 2.5 / (n - 1)


# --- (c) greedy generation ---------------------------------------------------------------------------


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    diff = (a != b).nonzero()
    return int(diff[0, 0]) if len(diff) else None


def test_greedy_generation_equals_transformers_and_is_deterministic(tokens, ref_model, kv_model, bf16_windows):
    rounding = bf16_windows[3]
    for start in (0, 500, 2000):  # 48 + 24 tokens each: inside the BF16 windows
        ids = torch.tensor([tokens[start:start + 48]])
        with torch.no_grad():
            want = ref_model.generate(ids, max_new_tokens=24, do_sample=False)
            first = kv_model.generate(ids, max_new_tokens=24, do_sample=False)
            second = kv_model.generate(ids, max_new_tokens=24, do_sample=False)
            ref_logits = ref_model(want, use_cache=False).logits[0, 47:-1]
        assert first.shape == want.shape
        assert torch.equal(first, second)
        # Token for token, except that BF16 windows move logits by up to 2 x the rounding effect
        # (test above): greedy may first part from SDPA's only where SDPA's top two are within
        # twice that.
        i = _first_difference(first[0, 48:], want[0, 48:])
        if i is not None:
            top2 = ref_logits[i].topk(2).values
            margin = (top2[0] - top2[1]).item()
            assert margin <= 4.0 * rounding, f"prompt at {start}: step {i} differs with SDPA margin {margin}"


def test_batch_rows_equal_single_rows(tokens, kv_model):
    # Rows are independent runtime sequences: a batch of two gives each row's own generation.
    rows = torch.tensor([tokens[:40], tokens[500:540]])
    with torch.no_grad():
        batched = kv_model.generate(rows, max_new_tokens=12, do_sample=False)
        single = [kv_model.generate(rows[i:i + 1], max_new_tokens=12, do_sample=False) for i in range(2)]
    for i in range(2):
        assert torch.equal(batched[i], single[i][0])


def test_greedy_through_int2_pages_is_deterministic(tokens, kv_model, artifact):
    # A 360-token prompt: the first pages are quantised during the prompt, more while decoding.
    ids = torch.tensor([tokens[1000:1360]])
    with torch.no_grad():
        a = kv_model.generate(ids, max_new_tokens=16, do_sample=False)
        b = kv_model.generate(ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(a, b)
    cache = khf.KvccCache.for_model(kv_model, artifact, max_tokens=400)
    with torch.no_grad():
        kv_model(ids, **khf.cache_kwargs(kv_model, cache))
    info = kvcc.load_artifact(artifact)
    assert cache.get_seq_length() == 360
    assert cache.runtime.length(cache.rows[0]) == 360
    # Tiers (docs/runtime.md): 64 sink tokens, 296 after them; the ring holds at most 256, so
    # one page of 64 went to history. Bytes per (layer, KV head): a page holds 64 tokens x (2 x 32
    # code bytes + 2 x 4 parameter bytes) = 4608 at d = 128; a window slot (64 + 256) x 128 BF16
    # keys and values.
    assert (info.sink, info.recent, info.page_size, info.head_dim) == (64, 256, 64, 128)
    assert kvcc.pages_for_tokens(info, 360) == 1
    heads = info.n_layers * info.n_kv_heads
    assert cache.bytes_in_use() == heads * 4608 + heads * (64 + 256) * 128 * 2 * 2


def test_beam_search_forks_rows(tokens, ref_model, kv_model):
    ids = torch.tensor([tokens[:32]])
    with torch.no_grad():
        want = ref_model.generate(ids, max_new_tokens=10, num_beams=2, do_sample=False)
        got = kv_model.generate(ids, max_new_tokens=10, num_beams=2, do_sample=False)
    assert torch.equal(got, want)


# --- refusals ----------------------------------------------------------------------------------------


def test_artifact_for_another_model_is_refused(kv_model):
    if not (TINY / "config.json").is_file():
        pytest.skip(f"{TINY} is absent")
    other = _zoo_artifact("tinystories-656k")
    with pytest.raises(kvcc.KvccError, match="compiled for another model"):
        khf.KvccCache.for_model(kv_model, other)
    with pytest.raises(kvcc.KvccError, match="compiled for another model"):
        khf.from_pretrained(MODEL, artifact=other)


def test_padded_batch_is_refused(tokens, kv_model):
    ids = torch.tensor([tokens[:16], tokens[100:116]])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with pytest.raises(kvcc.KvccError, match="padded"):
        kv_model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)


def test_forward_without_kvcc_cache_is_refused(tokens, kv_model):
    with pytest.raises(kvcc.KvccError, match="KvccCache"):
        with torch.no_grad():
            kv_model(torch.tensor([tokens[:8]]), use_cache=False)


def test_cache_full_names_the_sizing(tokens, kv_model, artifact):
    cache = khf.KvccCache.for_model(kv_model, artifact, max_tokens=330)
    ids = torch.tensor([tokens[:600]])
    with pytest.raises(kvcc.CacheFull, match="max_tokens"):
        with torch.no_grad():
            kv_model(ids, **khf.cache_kwargs(kv_model, cache))


def test_bad_sizes_and_missing_paths(kv_model, artifact, tmp_path):
    with pytest.raises(ValueError, match="max_tokens"):
        khf.KvccCache.for_model(kv_model, artifact, max_tokens=-5)
    with pytest.raises(kvcc.KvccError, match="no such artifact"):
        khf.KvccCache.for_model(kv_model, tmp_path / "missing.kvcc.h5")
    with pytest.raises(kvcc.KvccError, match="no such model directory"):
        khf.from_pretrained(tmp_path / "nope", artifact=artifact)
    sdpa = AutoModelForCausalLM.from_pretrained(MODEL, attn_implementation="sdpa")
    with pytest.raises(kvcc.KvccError, match="attn_implementation"):
        khf.KvccCache.for_model(sdpa, artifact)


def test_step_beyond_max_step_tokens_is_refused_before_anything_changes(tokens, kv_model, artifact):
    """The runtime's step tables are sized once for max_step_tokens (so a step can be replayed
    from a CUDA graph): a longer forward is refused with the remedy, and the cache is unchanged
    (a shorter block then goes through)."""
    cache = khf.KvccCache.for_model(kv_model, artifact, max_tokens=400, max_step_tokens=100)
    with torch.no_grad():
        with pytest.raises(kvcc.KvccError, match="max_step_tokens 100"):
            kv_model(torch.tensor([tokens[:150]]), **khf.cache_kwargs(kv_model, cache))
        assert cache.get_seq_length() == 0 and cache.runtime.length(cache.rows[0]) == 0
        kv_model(torch.tensor([tokens[:100]]), **khf.cache_kwargs(kv_model, cache))
    assert cache.get_seq_length() == 100 == cache.runtime.length(cache.rows[0])
    with pytest.raises(ValueError, match="max_step_tokens"):
        khf.KvccCache.for_model(kv_model, artifact, max_step_tokens=0)


def test_decode_graph_needs_cuda(tokens, kv_model, artifact):
    cache = khf.KvccCache.for_model(kv_model, artifact, max_tokens=64)
    with pytest.raises(kvcc.KvccError, match="CUDA graphs"):
        khf.DecodeGraph(kv_model, cache)
