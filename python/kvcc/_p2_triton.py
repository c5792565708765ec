"""The p2 value target's column weights w_j = Σ_i p_ij² of causal attention, without the T × T
probability matrix: a Triton kernel that recomputes each probability from q, k and the row
log-sum-exp of the attention that produced the output (flash attention returns it), the way flash
attention's backward pass recomputes them. Used by kvcc.calibrate for BF16/FP16 models on CUDA,
where the model's own attention kernel gives the output and this pass adds one Q·Kᵀ product.

Runs under Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors too, which is how the CPU
tests check it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _p2_columns_kernel(q_ptr, k_ptr, lse_ptr, w_ptr, T, scale, group: tl.constexpr, d: tl.constexpr,
                       stride_qh, stride_qt, stride_kh, stride_kt, stride_lh, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    # Program (n, h): key columns [n·BLOCK_N, (n+1)·BLOCK_N) of query head h, whose KV head is
    # h // group; every query row i >= the block's first column contributes exp(s_ij - lse_i)².
    n = tl.program_id(0)
    h = tl.program_id(1)
    cols = n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, d)
    k = tl.load(k_ptr + (h // group) * stride_kh + cols[:, None] * stride_kt + dims[None, :],
                mask=cols[:, None] < T, other=0.0)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float64)
    start = (n * BLOCK_N) // BLOCK_M * BLOCK_M
    for m0 in range(start, T, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        q = tl.load(q_ptr + h * stride_qh + rows[:, None] * stride_qt + dims[None, :], mask=rows[:, None] < T,
                    other=0.0)
        lse = tl.load(lse_ptr + h * stride_lh + rows, mask=rows < T, other=0.0)
        if IEEE:  # float32 inputs: exact float32 products (BF16/FP16 products are exact in any case)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        keep = (cols[None, :] <= rows[:, None]) & (rows[:, None] < T)
        p = tl.where(keep, tl.exp(s - lse[:, None]), 0.0)
        acc += tl.sum(p * p, axis=0).to(tl.float64)
    tl.store(w_ptr + h * T + cols, acc, mask=cols < T)


def p2_column_weights(q, k, lse, scale: float, group: int):
    """q [H, T, d], k [K, T, d] (H = K·group), lse [H, T] float32 (natural log of Σ_j exp(scale·s_ij)
    over j <= i): returns w [K, T] float64, w_j = Σ over the group's heads Σ_{i>=j} p_ij²."""
    import torch

    H, T, d = q.shape
    K = k.shape[0]
    if H != K * group or k.shape[1:] != (T, d) or lse.shape != (H, T):
        raise ValueError(f"p2_column_weights: shapes q {tuple(q.shape)} k {tuple(k.shape)} lse {tuple(lse.shape)} "
                         f"do not fit group {group}")
    if d & (d - 1) or d < 16:
        raise ValueError(f"p2_column_weights: head_dim {d} is not a power of two >= 16")
    # Rows may be strided (the model's [T, H, d] layout seen as [H, T, d]): only the last dim must be dense.
    q, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k))
    lse = lse.float().contiguous()
    w = torch.empty((H, T), dtype=torch.float64, device=q.device)
    block_m, block_n = 64, 64
    grid = (triton.cdiv(T, block_n), H)
    _p2_columns_kernel[grid](q, k, lse, w, T, float(scale), group, d, q.stride(0), q.stride(1), k.stride(0),
                             k.stride(1), lse.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
                             IEEE=q.dtype == torch.float32)
    return w.view(K, group, T).sum(dim=1)
