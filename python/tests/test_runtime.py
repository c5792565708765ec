"""kvcc.Runtime and the torch.ops.kvcc ops on CPU tensors (host pool, the CPU reference kernels),
checked against values computed another way:

- windows covering the whole sequence hold every token in BF16, so decode / prefill must equal
  torch's SDPA over bf16(x·R)·Rᵀ (an identity: R is the runtime's float32 rotation, so only the
  float32 rounding of the output separates them);
- with INT2 history, a torch re-implementation of the page codec and the attention
  (kvcc_reference.py, written from the spec, parameters read with h5py) gives the same values;
- torch.library.opcheck on each op, and the ops under torch.compile(backend="aot_eager").

CUDA variants of the identity tests run when a Hopper GPU is visible.
"""

from __future__ import annotations

import glob
import math
import os
import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("h5py")

import kvcc  # noqa: E402
import kvcc_reference as ref  # noqa: E402
from engine_tables import EngineTables  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ZOO = REPO / "zoo" / "published"


def zoo_artifact(model: str, method: str) -> str:
    found = sorted(glob.glob(str(ZOO / model / f"{method}-*" / "artifact.*.kvcc.h5")))
    assert found, f"no {method} artifact for {model} in {ZOO} (tracked in the repository)"
    return found[0]


# gutenberg-27m oscar: head_dim 128, 4 query heads on 2 KV heads, real rotations (the GPU shape).
GUT = zoo_artifact("gutenberg-27m", "oscar")
# stories260k oscar: head_dim 8, uniform grid (level tables: the oscar_lm fixture).
UNIFORM = zoo_artifact("stories260k", "oscar")
CLI = Path(os.environ.get("KVCC_CLI", REPO / "build" / "cli" / "kvcc"))

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
DEVICES = ["cpu"] + (["cuda"] if HOPPER else [])


def out_tol(v_stored: torch.Tensor) -> float:
    """Bound on |runtime - float64 reference| per output element: the runtime accumulates in
    float64 and rounds the output to float32 (half an ulp, 2^-24 relative). An output is a convex
    combination of stored value rows rotated back, so |out| <= max ||v_row||_2; twice the rounding
    bound covers the float64 sums on both sides."""
    return 2.0 ** -23 * float(v_stored.double().norm(dim=-1).max()) + 1e-12


class Sequences:
    """Drives a Runtime step by step and keeps every token it was given, per sequence and layer."""

    def __init__(self, rt: kvcc.Runtime, seed: int = 0, scale: float = 1.0):
        self.rt = rt
        self.gen = torch.Generator().manual_seed(seed)
        self.k: dict[int, list[list[torch.Tensor]]] = {}
        self.v: dict[int, list[list[torch.Tensor]]] = {}
        self.scale = scale

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen) * self.scale

    def add(self, seq: int | None = None, parent: int | None = None) -> int:
        if parent is not None:
            s = self.rt.fork(parent)
            self.k[s] = [list(x) for x in self.k[parent]]
            self.v[s] = [list(x) for x in self.v[parent]]
            return s
        s = self.rt.add_sequence()
        self.k[s] = [[] for _ in range(self.rt.n_layers)]
        self.v[s] = [[] for _ in range(self.rt.n_layers)]
        return s

    def step(self, counts: dict[int, int], check=None) -> None:
        """One step: begin_append, then per layer append (rows of the sequences in order) and
        check(layer, seqs) if given."""
        rt = self.rt
        seqs = list(counts)
        rt.begin_append(seqs, [counts[s] for s in seqs])
        for layer in range(rt.n_layers):
            ks, vs = [], []
            for s in seqs:
                k = self.randn(counts[s], rt.n_kv_heads, rt.head_dim)
                v = self.randn(counts[s], rt.n_kv_heads, rt.head_dim)
                self.k[s][layer].append(k)
                self.v[s][layer].append(v)
                ks.append(k)
                vs.append(v)
            dev = rt.device
            rt.append(layer, torch.cat(ks).to(dev), torch.cat(vs).to(dev))
            if check:
                check(layer, seqs)

    def tokens(self, seq: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat(self.k[seq][layer]), torch.cat(self.v[seq][layer])


# --------------------------------------------------------------------------------------------
# (a) the identity: windows hold everything in BF16


def sdpa_over_windows(art: ref.ArtifactRef, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      causal_from: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """torch SDPA (float64) over bf16(x·R)·Rᵀ; returns (out [T, n_heads, d], stored values for the tolerance)."""
    kk, vv, vst = [], [], []
    for h in range(art.n_kv):
        rk, rv = art.key[layer][h].rot, art.value[layer][h].rot
        kr, vr = ref.rotate_round(k[:, h], rk), ref.rotate_round(v[:, h], rv)
        kk.append(kr.double() @ rk.double().T if rk is not None else kr.double())
        vv.append(vr.double() @ rv.double().T if rv is not None else vr.double())
        vst.append(vr)
    K = torch.stack(kk, 0).unsqueeze(0)  # [1, n_kv, n, d]
    V = torch.stack(vv, 0).unsqueeze(0)
    Q = q.double().transpose(0, 1).unsqueeze(0)  # [1, n_heads, T, d]
    T, n = q.shape[0], k.shape[0]
    mask = None
    if causal_from is not None:
        mask = torch.arange(n)[None, :] <= (causal_from + torch.arange(T))[:, None]
    r = q.shape[1] // art.n_kv
    K, V = K.repeat_interleave(r, dim=1), V.repeat_interleave(r, dim=1)
    sm = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(q.shape[-1])).sqrt())
    out = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask, scale=sm)
    return out[0].transpose(0, 1).float(), torch.stack(vst, 1)


@pytest.mark.parametrize("device", DEVICES)
def test_windows_only_decode_and_prefill_equal_sdpa(device):
    art = ref.read_artifact(GUT)
    assert art.sink + art.recent >= 300  # the test's sequences stay inside the windows
    with kvcc.Runtime(GUT, max_pages=4, max_sequences=3, device=device) as rt:
        assert (rt.n_heads, rt.n_kv_heads, rt.head_dim) == (4, 2, 128)
        S = Sequences(rt, seed=1)
        a, b = S.add(), S.add()
        worst = [0.0]

        def check(layer, seqs):
            q = S.randn(len(seqs), rt.n_heads, rt.head_dim)
            out = rt.decode(layer, seqs, q.to(device)).cpu()
            for i, s in enumerate(seqs):
                k, v = S.tokens(s, layer)
                want, vst = sdpa_over_windows(art, layer, q[i:i + 1], k, v)
                tol = out_tol(vst) if device == "cpu" else gpu_tol(q[i:i + 1], k, vst)
                err = float((out[i] - want[0]).abs().max())
                worst[0] = max(worst[0], err / tol)
                assert err <= tol, f"layer {layer} seq {s}: |decode - SDPA| = {err:.3g} > {tol:.3g}"

        S.step({a: 57, b: 1}, check)  # a: sink and ring; b: one token
        S.step({a: 1, b: 130}, check)
        S.step({b: 1, a: 200}, check)  # order of sequences differs from their ids
        assert rt.length(a) == 258 and rt.length(b) == 132
        assert rt.bytes_in_use() > 0

        # prefill of T tokens before begin_append and between begin_append and append: both read
        # the cache as it was, plus the new tokens causally.
        T = 9
        gen = torch.Generator().manual_seed(7)
        q = torch.randn(T, rt.n_heads, rt.head_dim, generator=gen)
        kn = torch.randn(T, rt.n_kv_heads, rt.head_dim, generator=gen)
        vn = torch.randn(T, rt.n_kv_heads, rt.head_dim, generator=gen)
        before = [rt.prefill(L, b, q.to(device), kn.to(device), vn.to(device)).cpu() for L in range(rt.n_layers)]
        rt.begin_append([b], [T])
        for L in range(rt.n_layers):
            k, v = S.tokens(b, L)
            want, vst = sdpa_over_windows(art, L, q, torch.cat([k, kn]), torch.cat([v, vn]), causal_from=k.shape[0])
            tol = out_tol(vst) if device == "cpu" else gpu_tol(q, torch.cat([k, kn]), vst)
            err = float((before[L] - want).abs().max())
            assert err <= tol, f"prefill layer {L}: {err:.3g} > {tol:.3g}"
            inside = rt.prefill(L, b, q.to(device), kn.to(device), vn.to(device)).cpu()
            assert torch.equal(inside, before[L])  # the same kernel over the same cache
            rt.append(L, kn.to(device), vn.to(device))
        assert rt.length(b) == 132 + T
    print(f"windows-only {device}: worst error / tolerance {worst[0]:.2e}")


@pytest.mark.parametrize("device", DEVICES)
def test_evict_to_bf16_rows_equals_sdpa_over_the_kept_rows(device):
    """Runtime.evict through the C ABI: a sequence with INT2 history pages keeps only its sink and
    some ring tokens — rows that stay BF16 (re-tiered into the new sink and ring) — so decode must
    then equal SDPA over exactly those rows (the windows-only identity above), the history pages
    must all come back, and appends after the eviction must extend the kept rows."""
    art = ref.read_artifact(GUT)
    S_, W, P = art.sink, art.recent, kvcc.load_artifact(GUT).page_size
    n = S_ + 4 * P + W  # four history pages between the sink and the ring
    with kvcc.Runtime(GUT, max_pages=8, max_sequences=2, device=device) as rt:
        S = Sequences(rt, seed=3)
        a = S.add()
        S.step({a: n})
        assert rt.length(a) == n
        before = rt.bytes_in_use()
        ring = list(range(n - 100, n))  # in the ring (BF16), as is the sink
        kept = list(range(S_)) + ring
        released = rt.evict(a, kept)
        assert released == 4  # every history page
        assert rt.length(a) == len(kept)
        assert rt.bytes_in_use() < before
        with kvcc.Runtime(GUT, max_pages=8, max_sequences=2, device=device) as fresh:
            f = fresh.add_sequence()
            fresh.begin_append([f], [len(kept)])
            z = torch.zeros(len(kept), rt.n_kv_heads, rt.head_dim, device=device)
            for layer in range(rt.n_layers):
                fresh.append(layer, z, z)
            assert rt.bytes_in_use() == fresh.bytes_in_use()  # what a sequence of the kept length holds
        idx = torch.tensor(kept)
        for layer in range(rt.n_layers):
            S.k[a][layer] = [torch.cat(S.k[a][layer])[idx]]
            S.v[a][layer] = [torch.cat(S.v[a][layer])[idx]]

        def check(layer, seqs):
            q = S.randn(len(seqs), rt.n_heads, rt.head_dim)
            out = rt.decode(layer, seqs, q.to(device)).cpu()
            k, v = S.tokens(a, layer)
            want, vst = sdpa_over_windows(art, layer, q, k, v)
            tol = out_tol(vst) if device == "cpu" else gpu_tol(q, k, vst)
            err = float((out[0] - want[0]).abs().max())
            assert err <= tol, f"layer {layer}: |decode - SDPA| after eviction = {err:.3g} > {tol:.3g}"

        S.step({a: 1}, check)
        S.step({a: 20}, check)
        assert rt.length(a) == len(kept) + 21
        with pytest.raises(kvcc.KvccError):
            rt.evict(a, [5, 3])  # not ascending
        with pytest.raises(kvcc.KvccError):
            rt.evict(a, [rt.length(a)])  # past the end
        assert rt.length(a) == len(kept) + 21  # refusals change nothing


@pytest.mark.parametrize("device", DEVICES)
def test_attention_scores_are_causal_softmaxes_over_the_stored_keys(device):
    """Runtime.attention_scores through the C ABI on a sequence held in the BF16 windows: each
    position's softmax weights summed over the last W queries and each KV head's query heads equal
    a float64 causal softmax over the keys as stored (bf16(k·R_k), scored against q·R_k), and each
    head's scores sum to W·r. The CPU runtime rotates exactly as the reference does (float64, then
    rounded); the device's float32 rotation may store the other BF16 neighbour, which moves a
    logit by at most Δs = sm·||q||·max||k||·2^-8 and a weight by a factor exp(±2Δs)."""
    art = ref.read_artifact(GUT)
    n, W = 200, 16
    assert art.sink + art.recent >= n  # every key stays BF16
    with kvcc.Runtime(GUT, max_pages=4, max_sequences=2, device=device) as rt:
        S = Sequences(rt, seed=5)
        a = S.add()
        S.step({a: n})
        r = rt.n_heads // rt.n_kv_heads
        sm = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(rt.head_dim)).sqrt())
        for layer in range(rt.n_layers):
            q = S.randn(W, rt.n_heads, rt.head_dim)
            got = rt.attention_scores(layer, a, q.to(device)).cpu().double()
            assert got.shape == (rt.n_kv_heads, n)
            k, _ = S.tokens(a, layer)
            want = torch.zeros(rt.n_kv_heads, n, dtype=torch.float64)
            visible = torch.arange(n)[None, :] <= (n - W + torch.arange(W))[:, None]  # [W, n]
            for h in range(rt.n_kv_heads):
                rk = art.key[layer][h].rot
                kr = ref.rotate_round(k[:, h], rk).double()  # [n, d] as stored
                for qh in range(h * r, (h + 1) * r):
                    qr = q[:, qh].double() @ rk.double() if rk is not None else q[:, qh].double()
                    s = (qr @ kr.T) * sm
                    want[h] += torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1).sum(0)
            if device == "cpu":
                tol = 1e-6 * (1 + want)
            else:
                ds = sm * float(q.double().norm(dim=-1).max()) * float(k.double().norm(dim=-1).max()) * 2.0 ** -8
                tol = math.expm1(2 * ds) * want + 1e-5 * W * r
            err = (got - want).abs()
            assert bool((err <= tol).all()), f"layer {layer}: worst |scores - softmax| {float(err.max()):.3g}"
            assert torch.allclose(got.sum(1), torch.full((rt.n_kv_heads,), float(W * r), dtype=torch.float64),
                                  rtol=1e-5)
        with pytest.raises(kvcc.KvccError):
            rt.attention_scores(0, a, S.randn(n + 1, rt.n_heads, rt.head_dim).to(device))  # W beyond the length


def gpu_tol(q: torch.Tensor, k: torch.Tensor, v_stored: torch.Tensor) -> float:
    """Bound on |CUDA runtime - SDPA| per output element. The device rotates K/V with its own fp32
    GEMM, so a stored BF16 element may round to the other neighbour (|Δk_j| <= 2^-8·||k_j||, the
    same for v); the query enters the MMA as two BF16 halves (hi + lo, fp32-like: 2^-16); the
    probabilities are rounded to BF16 before P·V (2^-9 relative). A score then moves by at most
    Δs = sm·||q||·max||k||·(2^-8 + 2^-16), the softmax by exp(2Δs) - 1 in L1, so
    |Δout| <= (exp(2Δs) - 1 + 2^-9 + 2^-8)·max||v||, plus the float32 output rounding."""
    sm = 1.0 / math.sqrt(q.shape[-1])
    ds = sm * float(q.double().norm(dim=-1).max()) * float(k.double().norm(dim=-1).max()) * (2.0 ** -8 + 2.0 ** -16)
    vmax = float(v_stored.double().norm(dim=-1).max())
    return (math.expm1(2.0 * ds) + 2.0 ** -9 + 2.0 ** -8) * vmax + out_tol(v_stored)


# --------------------------------------------------------------------------------------------
# (b) INT2 history: the page codec re-implemented in torch


@pytest.fixture(scope="module")
def stories_stats(tmp_path_factory) -> Path:
    """Statistics of the repository's stories260k model from a small calibration by the CLI, for
    the artifacts the zoo does not publish."""
    if not CLI.is_file():
        pytest.skip(f"the kvcc CLI ({CLI}; set KVCC_CLI) is needed to compile the test's artifacts")
    d = tmp_path_factory.mktemp("stories_stats")
    ids = d / "ids.txt"
    ids.write_text("\n".join(" ".join(str((7 * i + 13 * j) % 500 + 3) for j in range(60)) for i in range(8)) + "\n")
    model = REPO / "cli" / "demo" / "stories260k" / "stories260K.bin"
    subprocess.run([str(CLI), "calibrate-model", "--model", str(model), "--ids", str(ids), "-o", str(d / "stats.h5")],
                   check=True, capture_output=True, text=True)
    return d / "stats.h5"


def compile_stories(stats: Path, name: str, *args: str) -> str:
    out = stats.parent / name
    subprocess.run([str(CLI), "compile", str(stats), *args, "-o", str(out)], check=True, capture_output=True, text=True)
    return str(out)


@pytest.fixture(scope="module")
def oscar_lm(stories_stats) -> str:
    """An oscar-lm artifact (4-level tables on both sides)."""
    return compile_stories(stories_stats, "lm.kvcc.h5", "--method", "oscar-lm", "--key-bits", "2", "--value-bits", "2")


@pytest.fixture(scope="module")
def oscar_widths(stories_stats) -> str:
    """An oscar artifact whose (layer, KV head) sides have their own code widths (compile
    --bits-budget: 1 to 3 bits here)."""
    return compile_stories(stories_stats, "widths.kvcc.h5", "--method", "oscar", "--bits-budget", "6")


@pytest.mark.parametrize("kind", ["uniform", "level_table", "widths"])
def test_int2_history_matches_torch_codec_reference(kind, request):
    path = {"uniform": lambda: UNIFORM, "level_table": lambda: request.getfixturevalue("oscar_lm"),
            "widths": lambda: request.getfixturevalue("oscar_widths")}[kind]()
    art = ref.read_artifact(path)
    info = kvcc.load_artifact(path)
    if kind == "level_table":
        # the level-table path is what this case tests
        assert all(s.levels is not None for side in (art.key, art.value) for row in side for s in row)
    else:
        assert all(s.levels is None for row in art.key for s in row)
    if kind == "widths":  # sides at 1, 2 and 3 bits
        widths = {s.bits for side in (art.key, art.value) for row in side for s in row}
        assert {1, 3} <= widths, widths
    n_max = art.sink + art.recent + 3 * art.page + 20
    pages = 2 * kvcc.pages_for_tokens(info, n_max) + kvcc.pages_for_tokens(info, n_max - 150)
    with kvcc.Runtime(path, max_pages=pages, max_sequences=3) as rt:
        S = Sequences(rt, seed=2, scale=2.0)
        a, b = S.add(), S.add()
        stats = {"checked": 0, "int2_effect": 0.0, "worst": 0.0}

        def check(layer, seqs):
            q = S.randn(len(seqs), rt.n_heads, rt.head_dim)
            out = rt.decode(layer, seqs, q)
            for i, s in enumerate(seqs):
                k, v = S.tokens(s, layer)
                ks, vs = ref.stored(art, layer, k, v)
                want = ref.attend(art, layer, q[i:i + 1], ks, vs)
                tol = out_tol(vs)
                err = float((out[i] - want[0]).abs().max())
                assert err <= tol, f"layer {layer} seq {s} len {k.shape[0]}: {err:.3g} > {tol:.3g}"
                stats["worst"] = max(stats["worst"], err / tol)
                if ref.tiers(art, k.shape[0])[1]:
                    bf16_only, _ = sdpa_over_windows(art, layer, q[i:i + 1], k, v)
                    stats["int2_effect"] = max(stats["int2_effect"], float((bf16_only - want).abs().max()) / tol)
                stats["checked"] += 1

        S.step({a: 300, b: 5}, check)
        S.step({a: 1, b: 1}, check)
        S.step({a: 150, b: 200}, check)  # both flush ring tokens into pages
        c = S.add(parent=a)  # shares a's pages, copies its windows
        S.step({c: 90, a: 2}, check)
        S.step({a: n_max - rt.length(a), b: 3, c: 1}, check)
        for s in (a, b, c):
            assert rt.length(s) == sum(x.shape[0] for x in S.k[s][0])
        assert ref.tiers(art, rt.length(a))[1] >= 3 * art.page

        # prefill over a cache with history, before and inside a step
        T = 6
        q = S.randn(T, rt.n_heads, rt.head_dim)
        kn = S.randn(T, rt.n_kv_heads, rt.head_dim)
        vn = S.randn(T, rt.n_kv_heads, rt.head_dim)
        for L in range(rt.n_layers):
            k, v = S.tokens(c, L)
            ks, vs = ref.stored(art, L, k, v)
            kr, vr = ref.stored(art, L, kn, vn)  # the new tokens as BF16 rows (fewer than the sink)
            want = ref.attend(art, L, q, torch.cat([ks, kr]), torch.cat([vs, vr]), causal_from=k.shape[0])
            got = rt.prefill(L, c, q, kn, vn)
            tol = out_tol(torch.cat([vs, vr]))
            assert float((got - want).abs().max()) <= tol
            # c with a (whose pages c shares) in one ragged prefill: each as the reference says
            ka, va = S.tokens(a, L)
            ksa, vsa = ref.stored(art, L, ka, va)
            qa = S.randn(2, rt.n_heads, rt.head_dim)
            want_a = ref.attend(art, L, qa, torch.cat([ksa, kr[:2]]), torch.cat([vsa, vr[:2]]),
                                causal_from=ka.shape[0])
            both = rt.prefill(L, [c, a], torch.cat([q, qa]), torch.cat([kn, kn[:2]]), torch.cat([vn, vn[:2]]),
                              counts=[T, 2])
            assert torch.equal(both[:T], got)  # the host pool runs each sequence alone
            assert float((both[T:] - want_a).abs().max()) <= out_tol(torch.cat([vsa, vr[:2]]))
        rt.free(b)
        rt.free(c)
    # the INT2 tier changes the output far beyond the tolerance: the history was really exercised
    assert stats["int2_effect"] > 100, stats
    print(f"{Path(path).parent.name}: {stats['checked']} decodes, worst error / tolerance {stats['worst']:.2e}; "
          f"INT2 vs BF16-only / tolerance up to {stats['int2_effect']:.0f}")


def test_pages_for_tokens_is_what_a_sequence_needs():
    info = kvcc.load_artifact(UNIFORM)
    art = ref.read_artifact(UNIFORM)
    for n in [0, 1, 63, 64, 319, 320, 321, 384, 385, 1000, 10 ** 9]:
        assert kvcc.pages_for_tokens(info, n) == ref.tiers(art, n)[1] // art.page, n
    n = 600
    need = kvcc.pages_for_tokens(info, n)
    assert need > 0
    with kvcc.Runtime(UNIFORM, max_pages=need, max_sequences=1) as rt:
        assert kvcc.pages_for_tokens(rt, n) == need
        s = rt.add_sequence()
        rt.begin_append([s], [n])  # exactly enough
        grow = next(m for m in range(1, 200) if kvcc.pages_for_tokens(info, n + m) > need)
        with pytest.raises(kvcc.CacheFull):
            rt.begin_append([s], [grow])
        assert rt.length(s) == n  # all or nothing
        rt.begin_append([s], [grow - 1])  # still fits


def test_bf16_inputs_convert_through_float32():
    with kvcc.Runtime(UNIFORM, max_pages=0, max_sequences=1) as rt:
        s = rt.add_sequence()
        gen = torch.Generator().manual_seed(3)
        rt.begin_append([s], [10])
        for L in range(rt.n_layers):
            k = torch.randn(10, rt.n_kv_heads, rt.head_dim, generator=gen).bfloat16()
            rt.append(L, k, k)
            q = torch.randn(1, rt.n_heads, rt.head_dim, generator=gen).bfloat16()
            out = rt.decode(L, [s], q)
            assert out.dtype == torch.bfloat16 and out.shape == q.shape
            assert torch.equal(out, rt.decode(L, [s], q.float()).bfloat16())
            # a non-contiguous query view gives the same as its contiguous copy
            qt = q.float().transpose(0, 1).contiguous().transpose(0, 1)
            assert torch.equal(rt.decode(L, [s], qt), rt.decode(L, [s], q.float()))


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_runtime_equals_rounded_float32(device):
    """A Runtime loaded with dtype=torch.bfloat16 takes bfloat16 tensors as they are and returns
    bfloat16; the kernels widen on load and round on store, so every output is the bfloat16 rounding
    of a float32 Runtime's on the same (widened) values, bit for bit, with INT2 history and prefill
    (GUT's artifact needs head_dim 128 for the device pool)."""
    path = GUT if device == "cuda" else UNIFORM
    kw = dict(max_pages=16, max_sequences=2, device=device)
    with kvcc.Runtime(path, **kw) as f32, kvcc.Runtime(path, dtype=torch.bfloat16, **kw) as b16:
        assert b16.dtype == torch.bfloat16
        gen = torch.Generator().manual_seed(5)
        # Two sequences a step, prefilled together (one ragged batch), then decoded.
        s, t = [f32.add_sequence() for _ in range(2)], [b16.add_sequence() for _ in range(2)]
        for counts in ((150, 40), (1, 1), (70, 3), (1, 1)):
            f32.begin_append(s, list(counts))
            b16.begin_append(t, list(counts))
            rows = sum(counts)
            for L in range(f32.n_layers):
                def randn(*shape):
                    return torch.randn(*shape, generator=gen).bfloat16().to(device)
                q = randn(rows, f32.n_heads, f32.head_dim)
                k, v = randn(rows, f32.n_kv_heads, f32.head_dim), randn(rows, f32.n_kv_heads, f32.head_dim)
                want = f32.prefill(L, s, q.float(), k.float(), v.float(), counts=counts)
                got = b16.prefill(L, t, q, k, v, counts=counts)
                assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16()), f"prefill layer {L}"
                f32.append(L, k.float(), v.float())
                b16.append(L, k, v)
                qd = randn(2, f32.n_heads, f32.head_dim)
                want = f32.decode(L, s, qd.float())
                got = b16.decode(L, t, qd)
                assert torch.equal(got, want.bfloat16()), f"decode layer {L} after +{counts}"
                # float32 queries into the bfloat16 runtime are rounded first, and come back float32
                assert torch.equal(b16.decode(L, t, qd.float()), got.float())
        assert [f32.length(x) for x in s] == [b16.length(x) for x in t] == [222, 45]
    with pytest.raises(kvcc.KvccError, match="dtype"):
        kvcc.Runtime(UNIFORM, max_pages=1, max_sequences=1, dtype=torch.float16)


# --------------------------------------------------------------------------------------------
# (c), (d): the custom ops


def _fresh(path=UNIFORM, n=12):
    rt = kvcc.Runtime(path, max_pages=0, max_sequences=2)
    s = rt.add_sequence()
    rt.begin_append([s], [n])
    return rt, s


def test_opcheck_each_op():
    from torch.library import opcheck

    rt, s = _fresh()
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(12, rt.n_kv_heads, rt.head_dim, generator=gen)
    # Within the windows (no page flush) appending the same rows again rewrites the same slots,
    # so opcheck may run append as often as it likes.
    opcheck(torch.ops.kvcc.append.default, (rt.handle, rt.state, 0, k, k.clone()))
    q = torch.randn(1, rt.n_heads, rt.head_dim, generator=gen)
    opcheck(torch.ops.kvcc.decode.default, (rt.handle, rt.state, 0, [s], q))
    T = 12  # inside the step: the sequence's count; layer 1 has not been appended yet
    qp = torch.randn(T, rt.n_heads, rt.head_dim, generator=gen)
    kp = torch.randn(T, rt.n_kv_heads, rt.head_dim, generator=gen)
    opcheck(torch.ops.kvcc.prefill.default, (rt.handle, rt.state, 1, [s], [T], qp, kp, kp.clone()))
    rt.close()


def test_ops_under_torch_compile_equal_eager():
    torch._dynamo.reset()
    eager, se = _fresh(n=5)
    comp, sc = _fresh(n=5)
    assert se == sc

    def layer_step(rt, layer, seq, k, v, q, qp, kp, vp):
        pre = rt.prefill(layer, seq, qp, kp, vp)
        rt.append(layer, k, v)
        return rt.decode(layer, [seq], q) * 2.0, pre

    compiled = torch.compile(layer_step, backend="aot_eager", fullgraph=True)
    gen = torch.Generator().manual_seed(5)
    for L in range(eager.n_layers):
        args = [torch.randn(5, eager.n_kv_heads, eager.head_dim, generator=gen) for _ in range(2)]
        args.append(torch.randn(1, eager.n_heads, eager.head_dim, generator=gen))
        args.append(torch.randn(5, eager.n_heads, eager.head_dim, generator=gen))
        args += [torch.randn(5, eager.n_kv_heads, eager.head_dim, generator=gen) for _ in range(2)]
        want = layer_step(eager, L, se, *args)
        got = compiled(comp, L, sc, *args)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # every append ran (none eliminated): both runtimes counted all layers
    assert int(comp.state) == int(eager.state) == eager.n_layers
    # and the compiled appends reached the cache: a later eager decode agrees
    q = torch.randn(1, eager.n_heads, eager.head_dim, generator=gen)
    assert torch.equal(eager.decode(0, [se], q), comp.decode(0, [sc], q))
    eager.close()
    comp.close()


def test_tensor_parallel_ranks_concatenate_to_the_whole_model():
    """Rank r of 2 serves KV head r and its query heads; kvcc_runtime.h: the ranks' outputs
    concatenated along the heads are the whole model's bit for bit (the same code per head)."""
    whole = kvcc.Runtime(GUT, max_pages=8, max_sequences=1)
    ranks = [kvcc.Runtime(GUT, max_pages=8, max_sequences=1, rank=r, ranks=2) for r in range(2)]
    assert [(r.n_heads, r.n_kv_heads) for r in ranks] == [(2, 1), (2, 1)]
    gen = torch.Generator().manual_seed(9)
    n = 400  # into INT2 history
    seqs = [rt.add_sequence() for rt in [whole, *ranks]]
    for rt, s in zip([whole, *ranks], seqs):
        rt.begin_append([s], [n])
    for L in range(whole.n_layers):
        k = torch.randn(n, 2, 128, generator=gen)
        v = torch.randn(n, 2, 128, generator=gen)
        q = torch.randn(1, 4, 128, generator=gen)
        whole.append(L, k, v)
        want = whole.decode(L, [seqs[0]], q)
        parts = []
        for r, (rt, s) in enumerate(zip(ranks, seqs[1:])):
            rt.append(L, k[:, r:r + 1].contiguous(), v[:, r:r + 1].contiguous())
            parts.append(rt.decode(L, [s], q[:, 2 * r:2 * r + 2].contiguous()))
        assert torch.equal(torch.cat(parts, dim=1), want)


# --------------------------------------------------------------------------------------------
# (e) an engine's own page tables (engine_tables=True)


ENGINE_STEPS = [  # (sequences, new tokens): ragged prefills into INT2 history, then decode steps
    ([0, 1, 2], [5, 140, 420]), ([1, 0], [300, 77]), ([2], [63]), ([0, 1, 2], [1, 1, 1]),
    ([0, 2], [1, 1]), ([2, 0, 1], [1, 1, 1]), ([1], [17]), ([0, 1, 2], [1, 1, 1]),
]


def test_engine_tables_serve_what_the_runtimes_own_tables_serve():
    """A Runtime fed an engine's tables (its own slots and a shuffled page order) serves, bit for
    bit, what a Runtime keeping its own tables serves on the same tokens: prefill of each new
    chunk, then decode of the step's sequences (the same CPU kernels over the same bytes; only
    where they live differs). A padded step (rows beyond the counts' sum) reads none of the padding."""
    kw = dict(max_pages=64, max_sequences=5)
    own = kvcc.Runtime(UNIFORM, **kw)
    eng = kvcc.Runtime(UNIFORM, **kw, max_batch=3, max_context=1200, max_step_tokens=800, engine_tables=True)
    gen = torch.Generator().manual_seed(21)
    seqs = [own.add_sequence() for _ in range(3)]
    tables = EngineTables(eng, [4, 1, 2], seed=22)  # not the Runtime's slots 0, 1, 2
    H, Hq, d = eng.n_kv_heads, eng.n_heads, eng.head_dim
    for si, (which, counts) in enumerate(ENGINE_STEPS):
        pad = 3 if si % 2 else 0
        slots, lengths, cnt, table = tables.step(which, counts)
        own.begin_append([seqs[i] for i in which], counts)
        eng.begin_step(slots, lengths, cnt, table, rows=sum(counts) + pad)
        assert eng.step_problem() == ""
        for L in range(eng.n_layers):
            qs, ks, vs, wants = [], [], [], []
            for j, (i, c) in enumerate(zip(which, counts)):
                q, k, v = torch.randn(c, Hq, d, generator=gen), torch.randn(c, H, d, generator=gen), \
                    torch.randn(c, H, d, generator=gen)
                want = own.prefill(L, seqs[i], q, k, v)
                got = eng.prefill_engine(L, tables.slots[i], tables.lengths[i], tables.pages_of(i), q, k, v)
                assert torch.equal(got, want), f"step {si} layer {L}: prefill of sequence {i}"
                qs.append(q)
                ks.append(k)
                vs.append(v)
                wants.append(want)
            # The step's sequences in one ragged prefill: each one's rows as it alone gets them.
            q, k, v, want = torch.cat(qs), torch.cat(ks), torch.cat(vs), torch.cat(wants)
            assert torch.equal(own.prefill(L, [seqs[i] for i in which], q, k, v, counts=counts), want)
            got = eng.prefill_engine(L, [tables.slots[i] for i in which], [tables.lengths[i] for i in which],
                                     [tables.pages_of(i) for i in which], q, k, v, counts=counts)
            assert torch.equal(got, want), f"step {si} layer {L}: ragged prefill"
            own.append(L, torch.cat(ks), torch.cat(vs))
            # padding rows far from any token: read, they would change every output
            ks.append(1e3 * torch.randn(pad, H, d, generator=gen))
            vs.append(1e3 * torch.randn(pad, H, d, generator=gen))
            eng.append(L, torch.cat(ks), torch.cat(vs))
            q = torch.randn(len(which), Hq, d, generator=gen)
            want = own.decode(L, [seqs[i] for i in which], q)
            assert torch.equal(eng.decode_step(L, q), want), f"step {si} layer {L}: decode"
            assert torch.equal(own.decode_step(L, q), want)  # the own step's sequences, the same
        tables.commit(which, counts)
    assert [own.length(s) for s in seqs] == tables.lengths
    assert sum(kvcc.pages_for_tokens(eng, n) > 0 for n in tables.lengths) >= 2  # INT2 history
    own.close()
    eng.close()


def _engine(**kw):
    return kvcc.Runtime(UNIFORM, max_pages=16, max_sequences=3, max_batch=2, max_context=600, max_step_tokens=300,
                        engine_tables=True, **kw)


def test_engine_tables_refuse_bad_steps_and_the_own_allocator():
    with pytest.raises(kvcc.KvccError, match="max_context"):
        kvcc.Runtime(UNIFORM, max_pages=16, max_sequences=3, engine_tables=True)
    rt = _engine()
    tables = EngineTables(rt, [0, 2], seed=3)
    slots, lengths, counts, table = tables.step([0, 1], [30, 20])
    H, d = rt.n_kv_heads, rt.head_dim

    def refused(match, *args, rows=None):
        with pytest.raises(kvcc.KvccError, match=match):
            rt.begin_step(*args, rows=rows)

    refused("int32", slots.long(), lengths, counts, table)
    refused("int32", slots, lengths, counts, table.long())
    refused(r"lengths has shape \(3,\)", slots, torch.zeros(3, dtype=torch.int32), counts, table)
    refused("block_table has shape", slots, lengths, counts, table[:1])
    refused("contiguous", slots, lengths, counts, table.t().contiguous().t())
    refused("block table rows of", slots, lengths, counts, table[:, :-1].contiguous())
    refused("k / v rows", slots, lengths, counts, table, rows=49)  # counts sum to 50
    refused("outside \\[0, max_step_tokens = 300\\]", slots, lengths, counts, table, rows=301)
    refused("rows must be >= 0", slots, lengths, counts, table, rows=-1)
    refused("window slot", torch.tensor([0, 3], dtype=torch.int32), lengths, counts, table)
    refused("given to two sequences", torch.tensor([2, 2], dtype=torch.int32), lengths, counts, table)
    refused("negative length or count", slots, lengths, torch.tensor([-1, 1], dtype=torch.int32), table)
    refused("max_batch", *tables.step([0, 1, 0], [1, 1, 1]))
    # nothing was opened by a refused step
    with pytest.raises(kvcc.KvccError, match="without an open step"):
        rt.append(0, torch.zeros(50, H, d), torch.zeros(50, H, d))
    rt.begin_step(slots, lengths, counts, table)  # rows: sum(counts) on the CPU
    with pytest.raises(kvcc.KvccError, match=r"shape \(49,"):
        rt.append(0, torch.zeros(49, H, d), torch.zeros(49, H, d))
    with pytest.raises(kvcc.KvccError, match="q has shape"):
        rt.decode_step(0, torch.zeros(3, rt.n_heads, d))
    with pytest.raises(kvcc.KvccError, match="pages holds 1 page ids"):
        rt.prefill_engine(0, 0, 590, torch.zeros(1, dtype=torch.int32), *(torch.zeros(1, n, d) for n in
                                                                             (rt.n_heads, H, H)))
    assert rt.step_problem() == ""  # a host pool refuses at begin_step instead
    # the Runtime's own allocator and calls are off; the engine calls need engine_tables
    for call in (rt.add_sequence, lambda: rt.begin_append([0], [1]),
                 lambda: rt.decode(0, [0], torch.zeros(1, rt.n_heads, d)),
                 lambda: rt.prefill(0, 0, *(torch.zeros(1, n, d) for n in (rt.n_heads, H, H)))):
        with pytest.raises(kvcc.KvccError):
            call()
    with kvcc.Runtime(UNIFORM, max_pages=16, max_sequences=3) as own:
        with pytest.raises(kvcc.KvccError, match="engine_tables"):
            own.begin_step(slots, lengths, counts, table)
        with pytest.raises(kvcc.KvccError, match="engine_tables"):
            own.prefill_engine(0, 0, 0, torch.zeros(1, dtype=torch.int32),
                               *(torch.zeros(1, n, d) for n in (rt.n_heads, H, H)))
    with pytest.raises(kvcc.KvccError, match="engine_tables must be a bool"):
        kvcc.Runtime(UNIFORM, max_pages=1, max_sequences=1, engine_tables=1)
    rt.close()


def test_opcheck_engine_ops():
    from torch.library import opcheck

    rt = _engine()
    tables = EngineTables(rt, [1], seed=4)
    gen = torch.Generator().manual_seed(6)
    step = tables.step([0], [12])
    # Within the windows the same step may be opened, and the same rows appended, any number of times.
    opcheck(torch.ops.kvcc.begin_step.default, (rt.handle, rt.state, *step, 12))
    H, Hq, d = rt.n_kv_heads, rt.n_heads, rt.head_dim
    qp, kp = torch.randn(12, Hq, d, generator=gen), torch.randn(12, H, d, generator=gen)
    opcheck(torch.ops.kvcc.prefill_engine.default, (rt.handle, rt.state, 0, [1], [0], [tables.pages_of(0)], [12],
                                                    qp, kp, kp.clone()))
    rt.append(0, kp, kp)
    opcheck(torch.ops.kvcc.decode_step.default, (rt.handle, rt.state, 0, torch.randn(1, Hq, d, generator=gen)))
    rt.close()


def test_engine_step_under_torch_compile_equals_eager():
    """A whole step (begin_step, then per layer prefill_engine + append + decode_step) compiled with
    fullgraph=True gives what it gives eagerly, and every begin_step and append ran."""
    torch._dynamo.reset()
    eager, comp = _engine(), _engine()
    te, tc = EngineTables(eager, [2, 0], seed=7), EngineTables(comp, [2, 0], seed=7)
    H, Hq, d = eager.n_kv_heads, eager.n_heads, eager.head_dim

    def step(rt, tables_step, rows, lengths, pages, ks, vs, qs, qps):
        rt.begin_step(*tables_step, rows=rows)
        outs = []
        for L in range(rt.n_layers):
            pre = rt.prefill_engine(L, 2, lengths[0], pages, qps[L], ks[L][:rows - 1], vs[L][:rows - 1])
            rt.append(L, ks[L], vs[L])
            outs.append(torch.cat([rt.decode_step(L, qs[L]).flatten(), pre.flatten()]))
        return torch.stack(outs)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    gen = torch.Generator().manual_seed(8)
    for counts in ([150, 1], [1, 1], [70, 1]):
        rows = sum(counts)
        nl = eager.n_layers
        ks = [torch.randn(rows, H, d, generator=gen) for _ in range(nl)]
        vs = [torch.randn(rows, H, d, generator=gen) for _ in range(nl)]
        qs = [torch.randn(2, Hq, d, generator=gen) for _ in range(nl)]
        qps = [torch.randn(counts[0], Hq, d, generator=gen) for _ in range(nl)]
        se, sc = te.step([0, 1], counts), tc.step([0, 1], counts)
        want = step(eager, se, rows, te.lengths, te.pages_of(0), ks, vs, qs, qps)
        got = compiled(comp, sc, rows, tc.lengths, tc.pages_of(0), ks, vs, qs, qps)
        assert torch.equal(got, want)
        te.commit([0, 1], counts)
        tc.commit([0, 1], counts)
    assert int(comp.state) == int(eager.state) == 3 * (1 + eager.n_layers)
    eager.close()
    comp.close()
