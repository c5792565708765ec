"""A small torch re-implementation of what the CPU reference runtime stores and computes, written
from the specification (formats/kv_layout.h tiers, formats/codec_scalar.h codecs,
runtime/append_ref.cpp and attention_ref.cpp semantics), with the artifact's rotations and codec
parameters read through h5py rather than through libkvcc_c. The tests compare the binding's
results with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import h5py
import numpy as np
import torch


@dataclass
class SideRef:
    rot: torch.Tensor | None  # [d, d] float32 as the runtime holds it (x_rot = x @ rot); None: identity
    clip_ratio: float  # the runtime's float32 value
    levels: torch.Tensor | None  # [4] float32, or None for the uniform grid
    bits: int = 2  # code bits: the side's own ("bits", compile --bits-budget) or the recipe's


@dataclass
class ArtifactRef:
    n_layers: int
    n_kv: int
    d: int
    group: int
    sink: int
    recent: int
    page: int
    key: list[list[SideRef]]  # [layer][kv head]
    value: list[list[SideRef]]


def read_artifact(path: str) -> ArtifactRef:
    with h5py.File(path, "r") as f:
        r = f["recipe"].attrs
        layers = f["layers"]
        n_layers = len(layers)
        n_kv = len(layers["0"])
        d = None
        sides: dict[str, list[list[SideRef]]] = {"key": [], "value": []}
        any_rot = False
        for L in range(n_layers):
            for name in ("key", "value"):
                row = []
                for h in range(n_kv):
                    g = layers[str(L)][f"kv{h}"][name]
                    rot = np.asarray(g["rotation"][()])
                    if rot.size:
                        any_rot = True
                        d = rot.shape[0]
                    levels = np.asarray(g["levels"][()]) if "levels" in g else None
                    bits = float(np.asarray(g["bits"][()]).reshape(-1)[0]) if "bits" in g else 0.0
                    row.append(SideRef(
                        rot=torch.from_numpy(rot.astype(np.float32)) if rot.size else None,
                        clip_ratio=float(np.float32(g.attrs["clip_ratio"])),
                        levels=torch.from_numpy(levels.astype(np.float32)) if levels is not None else None,
                        bits=int(bits or float(r[f"{name}_bits"])),
                    ))
                sides[name].append(row)
        head_dim = int(f["model"].attrs["head_dim"]) if "head_dim" in f["model"].attrs else d
        group = int(r["group"]) or head_dim
        ref = ArtifactRef(n_layers, n_kv, head_dim, group, int(r["sink"]), int(r["recent"]), int(r["page_size"]),
                          sides["key"], sides["value"])
    if any_rot:  # the runtime uses identity matrices for sides without a rotation
        for side in (ref.key, ref.value):
            for row in side:
                for s in row:
                    if s.rot is None:
                        s.rot = torch.eye(ref.d, dtype=torch.float32)
    return ref


def tiers(ref: ArtifactRef, n: int) -> tuple[int, int, int]:
    """(sink tokens, history tokens, ring tokens) of a sequence of length n (kv_layout.h tiers_of)."""
    sink = min(n, ref.sink)
    post = n - sink
    hist = 0 if post <= ref.recent else -(-(post - ref.recent) // ref.page) * ref.page
    return sink, hist, post - hist


def rotate_round(x: torch.Tensor, rot: torch.Tensor | None) -> torch.Tensor:
    """x [..., d] float32 -> bf16(x @ rot) as float32, as the cache stores it (formats/kv_rotation.h):
    column j of rot as integers Rq = RN(rot · 2^(14 − e_j)) (e_j: max |rot[:, j]| in [2^(e_j−1), 2^e_j)),
    each row as X = RN(x · 2^(22 − e_x)), the sum X @ Rq exact in int64, rounded once to bf16 (here
    by integer arithmetic on the sum's leading 8 bits; rows with NaN or inf give NaN)."""
    if rot is None:
        return x.float().bfloat16().float()
    xf, rf = x.float(), rot.float()
    e_col = torch.frexp(rf.abs().amax(dim=0)).exponent.long()  # [d]
    rq = torch.round(torch.ldexp(rf.double(), (14 - e_col).double())).long()
    e_row = torch.frexp(torch.nan_to_num(xf.abs(), nan=0.0, posinf=0.0).amax(dim=-1, keepdim=True)).exponent.long()
    xq = torch.round(torch.ldexp(torch.nan_to_num(xf.double(), nan=0.0, posinf=0.0, neginf=0.0),
                                 (22 - e_row).double())).long()
    t = xq @ rq  # exact: |t| < 2^43
    shift = e_row + e_col - 36
    a = t.abs()
    n = torch.frexp(a.double()).exponent.long() - 1  # a's leading bit (a < 2^53: exact)
    cut = (n - 7).clamp(min=0)
    m = a >> cut
    rem = a - (m << cut)
    half = torch.where(cut > 0, torch.ones_like(cut) << (cut - 1).clamp(min=0), torch.zeros_like(cut))
    up = (cut > 0) & ((rem > half) | ((rem == half) & (m % 2 == 1)))
    m = m + up.long()
    y = torch.ldexp(m.double(), (cut + shift).double()) * torch.sign(t).double()
    low = (n + shift < -126) & (a > 0)
    assert not bool(low.any()), "rotate_round: a bf16 subnormal result (not needed by the tests)"
    y = y.float()
    bad = ~torch.isfinite(xf).all(dim=-1, keepdim=True)
    return torch.where(bad, torch.full_like(y, float("nan")), y)


def _f16(x: torch.Tensor) -> torch.Tensor:
    return x.half().float()


def quantize_dequantize(rows: torch.Tensor, side: SideRef, group: int) -> torch.Tensor:
    """What the pages give back for rows [N, d] (float32 holding bf16 values) at the side's code
    bits: codec_scalar.h."""
    N, d = rows.shape
    x = rows.reshape(N, d // group, group)
    if side.levels is not None:
        ss = torch.zeros(x.shape[:2], dtype=torch.float32)
        for i in range(group):  # sequential float32 sum, as the C++ loop adds
            ss = ss + x[..., i] * x[..., i]
        # The correctly rounded float32 sqrt, as C++ std::sqrt gives: through float64 (exact enough
        # for any float32 input). torch's float32 sqrt on CPU may go through a vector library
        # accurate to about half an ulp, not exactly rounded (seen on AVX-512: one ulp off, which
        # moved a scale sitting on an fp16 rounding tie).
        s = _f16(torch.sqrt((ss / float(group)).double()).float())
        s = torch.where((s > 0) & torch.isfinite(s), s, torch.ones_like(s)).unsqueeze(-1)
        lv = side.levels
        xn = x / s
        code = torch.zeros_like(x, dtype=torch.int64)
        for i in range(3):
            code += (xn > torch.tensor(0.5, dtype=torch.float32) * (lv[i] + lv[i + 1])).long()
        deq = lv[code] * s
    else:
        k = min(max(int(np.floor(side.clip_ratio * group)), 1), group)
        thr = x.abs().kthvalue(k, dim=-1, keepdim=True).values
        xc = torch.maximum(torch.minimum(x, thr), -thr)
        lo = xc.amin(dim=-1, keepdim=True)
        hi = xc.amax(dim=-1, keepdim=True)
        top = float(2 ** side.bits - 1)
        s = _f16((hi - lo) / torch.tensor(top))
        s = torch.where((s > 0) & torch.isfinite(s), s, torch.ones_like(s))
        z = _f16(-lo / s)
        code = torch.floor(xc / s + z + torch.tensor(0.5)).clamp(0, top)
        deq = (code - z) * s
    return deq.reshape(N, d)


def stored(ref: ArtifactRef, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotated keys and values a sequence of these n tokens holds (k, v [n, n_kv, d] unrotated),
    decoded as attention reads them: BF16 sink and ring, INT2 history."""
    n = k.shape[0]
    sink, hist, _ = tiers(ref, n)
    ks, vs = [], []
    for h in range(ref.n_kv):
        kr = rotate_round(k[:, h], ref.key[layer][h].rot)
        vr = rotate_round(v[:, h], ref.value[layer][h].rot)
        if hist:
            sl = slice(sink, sink + hist)
            kr[sl] = quantize_dequantize(kr[sl], ref.key[layer][h], ref.group)
            vr[sl] = quantize_dequantize(vr[sl], ref.value[layer][h], ref.group)
        ks.append(kr)
        vs.append(vr)
    return torch.stack(ks, 1), torch.stack(vs, 1)


def attend(ref: ArtifactRef, layer: int, q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
           causal_from: int | None = None) -> torch.Tensor:
    """attention_ref.cpp in float64: q [T, n_heads, d] unrotated; ks, vs [n, n_kv, d] as stored.
    causal_from: query t sees tokens [0, causal_from + t] (prefill); None: all (decode, T = 1 per sequence)."""
    T, n_heads, d = q.shape
    r = n_heads // ref.n_kv
    sm = float(np.float32(1.0) / np.sqrt(np.float32(d)))
    out = torch.empty(T, n_heads, d, dtype=torch.float64)
    n = ks.shape[0]
    for qh in range(n_heads):
        h = qh // r
        rk, rv = ref.key[layer][h].rot, ref.value[layer][h].rot
        qr = q[:, qh].double() @ rk.double() if rk is not None else q[:, qh].double()
        s = qr @ ks[:, h].double().T * sm  # [T, n]
        if causal_from is not None:
            mask = torch.arange(n)[None, :] > (causal_from + torch.arange(T))[:, None]
            s = s.masked_fill(mask, float("-inf"))
        p = torch.softmax(s, dim=-1)
        o = p @ vs[:, h].double()
        out[:, qh] = o @ rv.double().T if rv is not None else o
    return out.float()
