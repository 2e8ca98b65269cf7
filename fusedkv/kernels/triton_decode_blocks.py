"""The building blocks of the Triton decode kernels (`triton_decode`: contiguous caches; `triton_paged_decode`:
vLLM's block tables): the device functions both stage-1 kernels are made of (fused queries, one key tile
of online softmax over 1-2 sources, the value fusion and the partial's store), the kernel that merges
the flash-decoding splits, and the launch heuristics. How and why they work: `triton_decode`'s docstring.

This module imports Triton at import time; import it lazily (``fusedkv.kernels`` does).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

Tensor = torch.Tensor

__all__ = ["choose_num_splits", "default_launch"]

_LOG2E = 1.4426950408889634


@triton.jit
def _qk(qa, k, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_G: tl.constexpr):
    # qa: [BLOCK_G, D] fp32 (already scaled and key-weighted), k: [BLOCK_N, D] -> [BLOCK_G, BLOCK_N] fp32
    if USE_DOT:
        if DOT_PRECISION == "ieee":
            s = tl.dot(qa, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(qa.to(k.dtype), tl.trans(k))
    elif BLOCK_G == 1:
        # MHA: plain 2-D multiply-reduce (a [1, N, D] broadcast compiles to more registers).
        s = tl.expand_dims(tl.sum(qa * k.to(tl.float32), axis=1), 0)
    else:
        s = tl.sum(qa[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
    return s


@triton.jit
def _pv(p, v, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_G: tl.constexpr):
    # p: [BLOCK_G, BLOCK_N] fp32, v: [BLOCK_N, D] -> [BLOCK_G, D] fp32
    if USE_DOT:
        if DOT_PRECISION == "ieee":
            o = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            o = tl.dot(p.to(v.dtype), v)
    elif BLOCK_G == 1:
        o = tl.expand_dims(tl.sum(tl.trans(p) * v.to(tl.float32), axis=0), 0)
    else:
        o = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    return o


@triton.jit
def _fused_queries(Q, K1, K2, KW1, KW2, b, j, heads, g_ok, offs_d, stride_qb, stride_qh, qk_scale,
                   HAS_K2: tl.constexpr, HAS_KW1: tl.constexpr, HAS_KW2: tl.constexpr,
                   USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, D: tl.constexpr):
    # The query heads of kv head j, with scale*log2(e) and the key weights folded in (query-side key
    # fusion, paper Sec. 3.3): returns (qa1, qa2), one per K source, [BLOCK_G, D].  qa2 is unused
    # (qa1) without a second K source.
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None], other=0.0).to(tl.float32) * qk_scale
    if HAS_KW1:
        qa1 = q * tl.load(KW1 + j * D + offs_d).to(tl.float32)[None, :]
    else:
        qa1 = q
    qa2 = qa1
    if HAS_K2:
        if HAS_KW2:
            qa2 = q * tl.load(KW2 + j * D + offs_d).to(tl.float32)[None, :]
        else:
            qa2 = q

    if USE_DOT:
        if DOT_PRECISION != "ieee":
            # Tensor-core operands in the cache dtype; converted once here, not per key block.
            qa1 = qa1.to(K1.dtype.element_ty)
            if HAS_K2:
                qa2 = qa2.to(K2.dtype.element_ty)
    return qa1, qa2


@triton.jit
def _softcap(s, cap2):
    # Gemma 2's soft cap on base-2 scores: s = log2(e) * x with x the scaled score and cap2 = log2(e) * c,
    # so c * tanh(x / c) in base 2 is cap2 * tanh(s / cap2).  tanh(y) = 1 - 2 / (e^(2y) + 1): finite for
    # every y (e^(2y) = inf gives 1, 0 gives -1), with an absolute error of a few fp32 ulps of 1.
    return cap2 - 2.0 * cap2 / (tl.exp2(s * (2.0 * 1.4426950408889634 / cap2)) + 1.0)


@triton.jit
def _attend_tile(qa1, qa2, k1_rows, k2_rows, v1_rows, v2_rows, n_ok, offs_d, m_i, l_i, acc1, acc2, softcap,
                 HAS_K2: tl.constexpr, HAS_V2: tl.constexpr, SOFTCAP: tl.constexpr,
                 USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_G: tl.constexpr):
    # One tile of BLOCK_N keys.  *_rows: [BLOCK_N] pointers to each key's D-vector in a source (the
    # kernels differ only in how they find them); n_ok: which keys are valid (others are not loaded).
    # Updates the running max m_i, sum l_i and the fp32 accumulator of each V source (online softmax).
    # SOFTCAP: cap the fused scores (softcap = log2(e) * c, see _softcap); the cap applies to the sum of
    # the sources' scores, the fused key's score (paper Sec. 3.3), not to each source's.
    k1 = tl.load(k1_rows[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
    s = _qk(qa1, k1, USE_DOT, DOT_PRECISION, BLOCK_G)
    if HAS_K2:
        k2 = tl.load(k2_rows[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        s += _qk(qa2, k2, USE_DOT, DOT_PRECISION, BLOCK_G)
    if SOFTCAP:
        s = _softcap(s, softcap)
    s = tl.where(n_ok[None, :], s, float("-inf"))

    # Online softmax (base 2); the caller visits only tiles holding >= 1 valid key, so m_new is finite.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)

    v1 = tl.load(v1_rows[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
    acc1 = acc1 * alpha[:, None] + _pv(p, v1, USE_DOT, DOT_PRECISION, BLOCK_G)
    if HAS_V2:
        v2 = tl.load(v2_rows[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        acc2 = acc2 * alpha[:, None] + _pv(p, v2, USE_DOT, DOT_PRECISION, BLOCK_G)
    return m_new, l_i, acc1, acc2


@triton.jit
def _fuse_values_and_store(acc1, acc2, m_i, l_i, VW1, VW2, O_PART, LSE_PART, OUT, b, j, split, heads, g_ok, offs_d,
                           stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                           HAS_V2: tl.constexpr, HAS_VW1: tl.constexpr, HAS_VW2: tl.constexpr,
                           SINGLE_SPLIT: tl.constexpr, D: tl.constexpr):
    # ---- output-side value fusion: b1 (.) (P V1) + b2 (.) (P V2), once per program (paper Sec. 3.3) --
    if HAS_VW1:
        o = acc1 * tl.load(VW1 + j * D + offs_d).to(tl.float32)[None, :]
    else:
        o = acc1
    if HAS_V2:
        if HAS_VW2:
            o += acc2 * tl.load(VW2 + j * D + offs_d).to(tl.float32)[None, :]
        else:
            o += acc2

    # False for an empty split or a row with no key (fully masked, or a paged sequence of length 0).
    has_keys = l_i > 0.0
    o = o / tl.where(has_keys, l_i, 1.0)[:, None]
    if SINGLE_SPLIT:
        tl.store(OUT + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(OUT.dtype.element_ty), mask=g_ok[:, None])
    else:
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(O_PART + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :],
                 o, mask=g_ok[:, None])
        tl.store(LSE_PART + b * stride_lb + heads * stride_lh + split, lse, mask=g_ok)


@triton.jit
def _fused_decode_combine(
    O_PART, LSE_PART, OUT,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    H_Q, NUM_SPLITS,
    BLOCK_S: tl.constexpr, D: tl.constexpr,
):
    # Merge split partials with their log-sum-exp (base 2): out = sum_i 2^(lse_i - M) o_i / sum_i 2^(...).
    pid = tl.program_id(0)
    b = (pid // H_Q).to(tl.int64)
    h = (pid % H_Q).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    s_ok = offs_s < NUM_SPLITS
    lse = tl.load(LSE_PART + b * stride_lb + h * stride_lh + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (fully masked row) -> output 0
    w = tl.exp2(lse - m)
    den = tl.sum(w, axis=0)
    o = tl.load(O_PART + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                mask=s_ok[:, None], other=0.0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(den > 0.0, den, 1.0)
    tl.store(OUT + b * stride_ob + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty))


# --------------------------------------------------------------------------------------------------
# Launch heuristics
# --------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # H100/H200; only matters for the interpreter, where any value is correct


def default_launch(d: int, block_g: int, use_dot: bool, n_sources: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps): keys per loop iteration and warps per program.

    Untuned guesses (no GPU was available when this was written) picked from register counts of
    offline sm_90 compiles, avoiding spills and keeping several programs per SM resident:
    the broadcast (non-dot) path holds a [BLOCK_G, BLOCK_N, D] fp32 product per source in registers,
    so its key block shrinks with G*D and the number of sources (MHA D=128: 64 keys, FusedKV: 32);
    the dot path keeps 64 keys (32 with 4 sources and 64 padded heads) and uses 8 warps for 64 heads.
    Override with ``block_n=`` / ``num_warps=`` (``python -m fusedkv.speed.gpu_suite --tune`` sweeps them).
    """
    if use_dot:
        if block_g >= 64:
            return (64 if n_sources <= 2 else 32), 8
        return 64, 4
    block_n = triton.next_power_of_2(max(1, 16384 // (block_g * d * n_sources)) + 1) // 2
    return max(16, min(64, block_n)), 4


def choose_num_splits(s: int, batch_heads: int, block_n: int, num_sms: int = 132,
                      min_blocks_per_split: int = 2, max_splits: int = 128) -> int:
    """Split the sequence so that ``batch_heads * num_splits`` fills about two waves of SMs.

    Each split keeps at least ``min_blocks_per_split`` key blocks so its fixed cost (loading q,
    writing a partial) stays small next to the streaming it does.
    """
    n_blocks = triton.cdiv(max(s, 1), block_n)
    want = triton.cdiv(2 * num_sms, max(batch_heads, 1))
    cap = max(1, n_blocks // min_blocks_per_split)
    return int(max(1, min(want, cap, max_splits)))


def _merge_splits(o_part: Tensor, lse_part: Tensor, out: Tensor) -> None:
    """Launch of the combine kernel: ``out[b, h]`` from the partials ``o_part [B, H_q, splits, D]`` (fp32)
    and their log-sum-exps ``lse_part [B, H_q, splits]`` (base 2) written by a stage-1 kernel."""
    bsz, h_q, num_splits, d = o_part.shape
    _fused_decode_combine[(bsz * h_q,)](
        o_part, lse_part, out,
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        out.stride(0), out.stride(1),
        h_q, num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits), D=d,
        num_warps=4 if d >= 128 else 2,
    )
