"""Triton flash-decoding kernel for FusedKV reconstruction layers (one new token, T_q = 1).

What it computes (per batch row ``b`` and query head ``h``, kv head ``j = h // G``)::

    K = sum_s a_s (.) K_s,  V = sum_s b_s (.) V_s          (1 or 2 sources each, a/b optional)
    out[b, h] = softmax(scale * q[b, h] . K[b, j, t]  over  kv_start[b] <= t < kv_end[b]) @ V[b, j]

How, and why:

* **No fused tensor.**  Key fusion is moved to the query, ``q . (a (.) k1 + c (.) kn) =
  (a (.) q) . k1 + (c (.) q) . kn``: each program multiplies its queries by the key weights once, then
  streams the raw caches.  Value fusion is moved to the output, ``sum_t p_t (b (.) v1_t + d (.) vn_t)
  = b (.) (P V1) + d (.) (P Vn)``: each V source gets its own fp32 accumulator and the weights are
  applied once to the partial output.  Decode is memory-bound, so the cost over a one-source kernel is
  only the extra bytes of the extra sources (FusedKV reads 4 caches, Lite and MHA 2).
* **Flash-decoding split.**  With T_q = 1 a (batch, kv head) grid has far fewer programs than the GPU
  has SMs (e.g. B=1, H_kv=2), so the sequence is cut into ``num_splits`` chunks, one program per
  (batch, kv head, split).  Each program keeps a running max / sum / accumulator in fp32 (online
  softmax) and writes a partial output and its log-sum-exp; a second tiny kernel merges the splits.
  With one split the first kernel writes the final output directly (no second launch).
* **GQA in one program.**  A program handles all G query heads of its kv head, so every K/V element is
  read once per program (not G times).  For G >= 5 the heads are padded to 16 rows and the two
  products use ``tl.dot`` (tensor cores; the padding costs nothing in a memory-bound kernel); for
  G <= 4 (incl. MHA) a broadcast-multiply-reduce avoids the 16-row minimum of ``tl.dot``.
* Scale and ``log2(e)`` are folded into q so the softmax uses ``exp2``.  Keys outside
  ``[kv_start, kv_end)`` are not loaded at all (left padding costs no bandwidth).  Batch offsets are
  computed in int64: a [8, 16, 128k, 128] cache has more than 2^31 elements.

The device functions, the split-merging kernel and the launch heuristics it shares with the paged kernel
are in `triton_decode_blocks`. This module imports Triton at import time; import it lazily
(``fusedkv.kernels`` does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .reference import merge_duplicate_sources, normalize_sources
from .triton_decode_blocks import (
    _LOG2E,
    _attend_tile,
    _fuse_values_and_store,
    _fused_queries,
    _merge_splits,
    _num_sms,
    choose_num_splits,
    default_launch,
)

Tensor = torch.Tensor

__all__ = ["fused_decode_attention", "decode_step", "choose_num_splits", "default_launch"]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _fused_decode_stage1(
    Q, K1, K2, V1, V2, KW1, KW2, VW1, VW2, KV_START, KV_END,
    O_PART, LSE_PART, OUT,
    stride_qb, stride_qh,
    stride_k1b, stride_k1h, stride_k1s,
    stride_k2b, stride_k2h, stride_k2s,
    stride_v1b, stride_v1h, stride_v1s,
    stride_v2b, stride_v2h, stride_v2s,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    H_KV, S, G, CHUNK, qk_scale,
    HAS_K2: tl.constexpr, HAS_V2: tl.constexpr,
    HAS_KW1: tl.constexpr, HAS_KW2: tl.constexpr, HAS_VW1: tl.constexpr, HAS_VW2: tl.constexpr,
    HAS_KV_START: tl.constexpr, HAS_KV_END: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid_bh // H_KV).to(tl.int64)  # int64: b * stride_b can exceed 2^31
    j = (pid_bh % H_KV).to(tl.int64)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    g_ok = offs_g < G
    heads = j * G + offs_g  # query heads of kv head j

    qa1, qa2 = _fused_queries(Q, K1, K2, KW1, KW2, b, j, heads, g_ok, offs_d, stride_qb, stride_qh, qk_scale,
                              HAS_K2, HAS_KW1, HAS_KW2, USE_DOT, DOT_PRECISION, D)

    # ---- key range of this split, clipped to the valid window [kv_start, kv_end) ------------------
    # Positions fit in int32; keeping the loop bounds int32 keeps the loop counter 32-bit.
    kv_lo = 0
    if HAS_KV_START:
        kv_lo = tl.load(KV_START + b).to(tl.int32)
    kv_hi = S
    if HAS_KV_END:
        kv_hi = tl.minimum(tl.load(KV_END + b).to(tl.int32), S)
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, kv_hi)
    # Skip whole blocks left of kv_start (left padding); keep block alignment of the loop.
    lo = tl.maximum(lo, (kv_lo // BLOCK_N) * BLOCK_N)
    # No valid key in this split (or the whole row masked: kv_start >= kv_end): run no iteration.
    # Otherwise every visited block holds >= 1 valid key, which keeps the running max finite.
    hi = tl.where(kv_lo < hi, hi, lo)

    k1_base = K1 + b * stride_k1b + j * stride_k1h
    v1_base = V1 + b * stride_v1b + j * stride_v1h
    k2_base = K2 + b * stride_k2b + j * stride_k2h
    v2_base = V2 + b * stride_v2b + j * stride_v2h

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc1 = tl.zeros([BLOCK_G, D], tl.float32)
    acc2 = tl.zeros([BLOCK_G, D], tl.float32)

    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = (offs_n >= kv_lo) & (offs_n < hi)
        m_i, l_i, acc1, acc2 = _attend_tile(
            qa1, qa2, k1_base + offs_n * stride_k1s, k2_base + offs_n * stride_k2s,
            v1_base + offs_n * stride_v1s, v2_base + offs_n * stride_v2s, n_ok, offs_d, m_i, l_i, acc1, acc2,
            0.0, HAS_K2, HAS_V2, False, USE_DOT, DOT_PRECISION, BLOCK_G)

    _fuse_values_and_store(acc1, acc2, m_i, l_i, VW1, VW2, O_PART, LSE_PART, OUT, b, j, split, heads, g_ok, offs_d,
                           stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                           HAS_V2, HAS_VW1, HAS_VW2, SINGLE_SPLIT, D)


# --------------------------------------------------------------------------------------------------
# Wrapper
# --------------------------------------------------------------------------------------------------
def _prep_source(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _prep_weight(w: Tensor | None, ref: Tensor) -> Tensor | None:
    # Weights are tiny ([H_kv, D]); contiguous on q's device so the kernel can index j * D + d (it reads
    # them as fp32 whatever their dtype).
    return None if w is None else w.to(device=ref.device).contiguous()


def fused_decode_attention(
    q: Tensor,
    k_sources: Tensor | Sequence[Tensor],
    k_weights: Tensor | Sequence[Tensor | None] | None,
    v_sources: Tensor | Sequence[Tensor],
    v_weights: Tensor | Sequence[Tensor | None] | None,
    kv_start: Tensor | None = None,
    scale: float | None = None,
    num_splits: int | None = None,
    *,
    kv_end: Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> Tensor:
    """Decode attention of one new token over fused KV sources.

    Args:
        q: ``[B, H_q, D]`` (the single new query token).
        k_sources, v_sources: 1 or 2 tensors ``[B, H_kv, S, D]`` each (a tensor listed twice is merged).
        k_weights, v_weights: per source ``[H_kv, D]`` (or ``[D]``) weight or None (= plain reuse).
        kv_start: LongTensor ``[B]``; keys at positions ``< kv_start[b]`` are masked (left padding).
        scale: softmax scale, default ``1/sqrt(D)``.
        num_splits: sequence splits (flash-decoding); None picks one from S and B*H_kv.
        kv_end: optional LongTensor ``[B]``; keys at positions ``>= kv_end[b]`` are masked (e.g. a
            pre-allocated cache that is only partly filled).
        block_n, num_warps, num_stages: launch overrides for tuning.

    Returns ``[B, H_q, D]`` in q's dtype.  A row with no key to attend to returns zeros.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H_q, D], got {tuple(q.shape)}")
    ks, kw = normalize_sources(k_sources, k_weights)
    vs, vw = normalize_sources(v_sources, v_weights)
    ks, kw = merge_duplicate_sources(ks, kw)
    vs, vw = merge_duplicate_sources(vs, vw)
    if len(ks) > 2 or len(vs) > 2:
        raise NotImplementedError("the Triton kernel takes at most 2 distinct K and 2 distinct V sources; "
                                  "use fusedkv.kernels.factored_attention for more")
    bsz, h_q, d = q.shape
    b2, h_kv, s, d2 = ks[0].shape
    if vs[0].shape != ks[0].shape or b2 != bsz or d2 != d:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, K {tuple(ks[0].shape)}, "
                         f"V {tuple(vs[0].shape)}")
    if h_q % h_kv:
        raise ValueError(f"H_q={h_q} is not a multiple of H_kv={h_kv}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {d}")
    for t in (q, *ks, *vs):
        if t.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(f"unsupported dtype {t.dtype}; use fp32, fp16 or bf16")
    if len({t.dtype for t in (*ks, *vs)}) != 1:
        raise TypeError("all K/V sources must share one dtype")
    q = q if q.stride(-1) == 1 else q.contiguous()
    ks = [_prep_source(x) for x in ks]
    vs = [_prep_source(x) for x in vs]
    kw = [_prep_weight(w, q) for w in kw]
    vw = [_prep_weight(w, q) for w in vw]
    if kv_start is not None:
        kv_start = kv_start.to(device=q.device, dtype=torch.int64).reshape(bsz).contiguous()
    if kv_end is not None:
        kv_end = kv_end.to(device=q.device, dtype=torch.int64).reshape(bsz).contiguous()
    return decode_step(q, ks, kw, vs, vw, kv_start, scale, num_splits, kv_end=kv_end, block_n=block_n,
                       num_warps=num_warps, num_stages=num_stages)


def decode_step(
    q: Tensor,
    ks: list[Tensor],
    kw: list[Tensor | None],
    vs: list[Tensor],
    vw: list[Tensor | None],
    kv_start: Tensor | None = None,
    scale: float | None = None,
    num_splits: int | None = None,
    *,
    kv_end: Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> Tensor:
    """The launch, on arguments already in the kernel's form and not checked again: q [B, H_q, D] with
    unit stride in D; 1-2 distinct sources per side [B, H_kv, S, D] with unit stride in D; weights None
    or contiguous [H_kv, D] on q's device; kv_start / kv_end int64 [B] or None."""
    bsz, h_q, d = q.shape
    h_kv, s = ks[0].shape[1], ks[0].shape[2]
    g = h_q // h_kv
    device = q.device
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)

    use_dot = g > 4
    # fp32 inputs: exact fp32 products (tf32 would cost ~1e-3 relative error); fp16/bf16: tensor-core
    # products in the input dtype.  The Triton 3.9 interpreter computes bf16 tl.dot wrongly (garbage
    # values), so there bf16 operands are upcast and multiplied in fp32 too.
    on_interpreter = q.device.type == "cpu"
    exact = ks[0].dtype == torch.float32 or (on_interpreter and ks[0].dtype == torch.bfloat16)
    dot_precision = "ieee" if exact else "default"
    block_g = max(16, triton.next_power_of_2(g)) if use_dot else triton.next_power_of_2(g)
    n_src = len(ks) + len(vs)
    auto_n, auto_warps = default_launch(d, block_g, use_dot, n_src)
    if use_dot and exact:
        auto_n = max(16, auto_n // 2)  # fp32 tiles are twice as large (registers, shared memory)
    block_n = auto_n if block_n is None else int(block_n)
    if num_splits is None:
        num_splits = choose_num_splits(s, bsz * h_kv, block_n, _num_sms(device))
    num_splits = max(1, min(int(num_splits), triton.cdiv(max(s, 1), block_n)))
    # Chunk per split, a multiple of block_n so that splits never share a block.
    chunk = triton.cdiv(triton.cdiv(max(s, 1), num_splits), block_n) * block_n
    if num_warps is None:
        num_warps = auto_warps
    if num_stages is None:
        num_stages = 2

    out = torch.empty(bsz, h_q, d, dtype=q.dtype, device=device)
    single = num_splits == 1
    if single:
        o_part = out  # unused placeholders (the kernel writes OUT directly)
        lse_part = out
        sp = (0, 0, d)
        sl = (0, 0)
    else:
        o_part = torch.empty(bsz, h_q, num_splits, d, dtype=torch.float32, device=device)
        lse_part = torch.empty(bsz, h_q, num_splits, dtype=torch.float32, device=device)
        sp = o_part.stride()[:3]
        sl = lse_part.stride()[:2]

    k1 = ks[0]
    k2 = ks[1] if len(ks) > 1 else k1
    v1 = vs[0]
    v2 = vs[1] if len(vs) > 1 else v1
    kw1 = kw[0]
    kw2 = kw[1] if len(kw) > 1 else None
    vw1 = vw[0]
    vw2 = vw[1] if len(vw) > 1 else None
    dummy = out  # any tensor: pointers of disabled features are never dereferenced

    grid = (bsz * h_kv, num_splits)
    _fused_decode_stage1[grid](
        q, k1, k2, v1, v2,
        kw1 if kw1 is not None else dummy, kw2 if kw2 is not None else dummy,
        vw1 if vw1 is not None else dummy, vw2 if vw2 is not None else dummy,
        kv_start if kv_start is not None else dummy, kv_end if kv_end is not None else dummy,
        o_part, lse_part, out,
        q.stride(0), q.stride(1),
        k1.stride(0), k1.stride(1), k1.stride(2),
        k2.stride(0), k2.stride(1), k2.stride(2),
        v1.stride(0), v1.stride(1), v1.stride(2),
        v2.stride(0), v2.stride(1), v2.stride(2),
        sp[0], sp[1], sp[2],
        sl[0], sl[1],
        out.stride(0), out.stride(1),
        h_kv, s, g, chunk, scale * _LOG2E,
        HAS_K2=len(ks) > 1, HAS_V2=len(vs) > 1,
        HAS_KW1=kw1 is not None, HAS_KW2=kw2 is not None,
        HAS_VW1=vw1 is not None, HAS_VW2=vw2 is not None,
        HAS_KV_START=kv_start is not None, HAS_KV_END=kv_end is not None, SINGLE_SPLIT=single,
        USE_DOT=use_dot, DOT_PRECISION=dot_precision,
        BLOCK_G=block_g, BLOCK_N=block_n, D=d,
        num_warps=num_warps, num_stages=num_stages,
    )
    if not single:
        _merge_splits(o_part, lse_part, out)
    return out
