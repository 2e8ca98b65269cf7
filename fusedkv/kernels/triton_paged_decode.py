"""Triton flash-decoding kernel for FusedKV reconstruction layers over vLLM's paged KV caches.

The same computation as :mod:`fusedkv.kernels.triton_decode` (one new query token per sequence; the
factored identity of paper Sec. 3.3 moves key fusion onto the query and value fusion onto the output,
so no fused K/V is written)::

    out[b, h] = sum_s b_s (.) (P V_s[b, j]),   P = softmax(scale * sum_s (a_s (.) q[b, h]) . K_s[b, j, t])

over ``t < seq_lens[b]``, ``j = h // G``, with 1-2 K and 1-2 V sources.  What differs is where a key
lives: each source is a vLLM GPU cache ``[num_blocks, block_size, H_kv, D]`` (the FlashAttention and
Triton backends' ``kv_cache.transpose(1, 2).split(D, -1)`` view of ``[num_blocks, H_kv, block_size,
2 * D]``, any strides with unit stride in D), and token ``t`` of sequence ``b`` sits in physical block
``block_table[b, t // block_size]``, slot ``t % block_size``.  The kernel looks the block up per key
(one small int load, cached), so the source layers' blocks are read in place: nothing is gathered.

The split over the sequence (flash-decoding), GQA in one program, exp2 softmax and the split merge are
those of ``triton_decode``, whose helpers this kernel calls: the query with the key weights folded in, the
online-softmax update of one tile, the value fusion and store, and the merge of the splits.  Only the key
range of a split and the addressing of a tile (block table + slot) are this kernel's own.
Split sizes depend only on the block table's width (the longest sequence a request can have) unless the
caller passes ``max_seq_len``: the launch then never reads a device value, so it can be captured in a
CUDA graph and replayed with longer sequences.  Splits past a sequence's end run no iteration.

Two features of served architectures, each behind a constexpr (compiled out when off):

* a sliding window W: the query at position ``p = seq_lens[b] - 1`` sees ``p - W < t <= p``, the last W
  positions (the model's convention, and vLLM's: FlashAttention's ``window_size`` is ``(W - 1, 0)``).  The
  splits cut only that range (from its start rounded down to a tile), so a key left of the window is
  never loaded: the blocks a window layer has freed are not read, and long sequences cost O(W).
* Gemma 2's attention logit soft cap c: scores -> ``c * tanh(scores / c)`` after the scale, before the
  softmax.  The cap is not linear, so it applies to the fused score (the sum over K sources above), never
  per source; ``tanh`` is written with ``exp2`` (finite everywhere, a few fp32 ulps of c from exact).

This module imports Triton at import time; import it lazily.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .reference import expand_weight
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

__all__ = ["paged_decode_attention", "paged_decode_step"]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# vLLM's 8-bit caches (`--kv-cache-dtype fp8`: uint8 tensors viewed as these), read and widened to fp32 in the
# kernel; their per-layer scales are folded into the fusion weights by the caller (`fusedkv.serving.paged`).
_FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@triton.jit
def _paged_decode_stage1(
    Q, K1, K2, V1, V2, KW1, KW2, VW1, VW2, BLOCK_TABLE, SEQ_LENS,
    O_PART, LSE_PART, OUT,
    stride_qb, stride_qh,
    stride_k1n, stride_k1t, stride_k1h,
    stride_k2n, stride_k2t, stride_k2h,
    stride_v1n, stride_v1t, stride_v1h,
    stride_v2n, stride_v2t, stride_v2h,
    stride_btb,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    H_KV, G, CHUNK, qk_scale, WINDOW, softcap,
    HAS_K2: tl.constexpr, HAS_V2: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_KW1: tl.constexpr, HAS_KW2: tl.constexpr, HAS_VW1: tl.constexpr, HAS_VW2: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid_bh // H_KV).to(tl.int64)
    j = (pid_bh % H_KV).to(tl.int64)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    g_ok = offs_g < G
    heads = j * G + offs_g

    qa1, qa2 = _fused_queries(Q, K1, K2, KW1, KW2, b, j, heads, g_ok, offs_d, stride_qb, stride_qh, qk_scale,
                              HAS_K2, HAS_KW1, HAS_KW2, USE_DOT, DOT_PRECISION, D)

    # ---- this split's keys: [base + split * CHUNK, min(+CHUNK, seq_len)); none past the sequence's end -
    # With a window W the query (position seq_len - 1) sees keys win_lo = seq_len - W .. seq_len - 1; the
    # splits share the keys from win_lo rounded down to a tile, so none visits (or loads) a key left of the
    # window but the first tile's few, which are masked (a window layer's freed blocks are never read).
    seq_len = tl.load(SEQ_LENS + b).to(tl.int32)
    win_lo = 0
    base = 0
    if HAS_WINDOW:
        win_lo = tl.maximum(seq_len - WINDOW, 0)
        base = (win_lo // BLOCK_N) * BLOCK_N
    lo = base + split * CHUNK
    hi = tl.minimum(lo + CHUNK, seq_len)
    hi = tl.where(lo < hi, hi, lo)

    # The kv head's offset within a slot; the block and slot offsets are added per key.
    k1_head = K1 + j * stride_k1h
    k2_head = K2 + j * stride_k2h
    v1_head = V1 + j * stride_v1h
    v2_head = V2 + j * stride_v2h
    table = BLOCK_TABLE + b * stride_btb

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc1 = tl.zeros([BLOCK_G, D], tl.float32)
    acc2 = tl.zeros([BLOCK_G, D], tl.float32)

    # Every visited tile holds >= 1 valid key (lo < seq_len, and the first holds win_lo), which keeps the
    # running max finite.
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        if HAS_WINDOW:
            n_ok = n_ok & (offs_n >= win_lo)
        # Physical block of each key (int64: block * block stride can pass 2^31 elements).
        block = tl.load(table + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
        slot = (offs_n % PAGE).to(tl.int64)
        k1_rows = k1_head + (block * stride_k1n + slot * stride_k1t)
        k2_rows = k2_head + (block * stride_k2n + slot * stride_k2t)
        v1_rows = v1_head + (block * stride_v1n + slot * stride_v1t)
        v2_rows = v2_head + (block * stride_v2n + slot * stride_v2t)
        m_i, l_i, acc1, acc2 = _attend_tile(qa1, qa2, k1_rows, k2_rows, v1_rows, v2_rows, n_ok, offs_d,
                                            m_i, l_i, acc1, acc2, softcap, HAS_K2, HAS_V2, SOFTCAP,
                                            USE_DOT, DOT_PRECISION, BLOCK_G)

    _fuse_values_and_store(acc1, acc2, m_i, l_i, VW1, VW2, O_PART, LSE_PART, OUT, b, j, split, heads, g_ok, offs_d,
                           stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                           HAS_V2, HAS_VW1, HAS_VW2, SINGLE_SPLIT, D)


def paged_decode_attention(
    q: Tensor,
    key_caches: Sequence[Tensor],
    k_weights: Sequence[Tensor | None] | None,
    value_caches: Sequence[Tensor],
    v_weights: Sequence[Tensor | None] | None,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float | None = None,
    *,
    out: Tensor | None = None,
    max_seq_len: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> Tensor:
    """Decode attention of one new token per sequence over paged fused KV sources, with argument checks.

    Args:
        q: ``[B, H_q, D]``, one query token per sequence (unit stride in D).
        key_caches, value_caches: 1 or 2 caches each, ``[num_blocks, block_size, H_kv, D]`` (vLLM's
            GPU layout; any strides with unit stride in D), all of one shape and dtype.
        k_weights, v_weights: per source an ``[H_kv, D]`` (or ``[D]``) weight or None (plain reuse);
            None for the whole list means no weights.
        block_table: int32/int64 ``[B, max_blocks]``; row b lists sequence b's physical blocks in order.
        seq_lens: ``[B]`` tokens of sequence b (keys ``>= seq_lens[b]`` are not read; 0 gives zeros).
        scale: softmax scale, default ``1/sqrt(D)``.
        out: optional ``[B, H_q, D]`` tensor (q's dtype) to write into, e.g. rows of vLLM's output.
        max_seq_len: an upper bound of ``seq_lens`` (None: the block table's width * block_size).
        window: a sliding window W >= 1: the query (position ``seq_lens[b] - 1``) sees only the last W keys,
            ``seq_lens[b] - W <= t`` (the model's and vLLM's convention, p - W < t <= p); keys left of it
            are not read. None: every key.
        softcap: Gemma 2's attention logit soft cap c > 0: scores -> c * tanh(scores / c) after the scale,
            before the softmax. None (or 0, vLLM's "off"): no cap.
        num_splits, block_n, num_warps: launch overrides.

    Returns ``out`` (or a new ``[B, H_q, D]`` tensor in q's dtype).
    """
    ks, vs = list(key_caches), list(value_caches)
    kw = [None] * len(ks) if k_weights is None else list(k_weights)
    vw = [None] * len(vs) if v_weights is None else list(v_weights)
    if not 1 <= len(ks) <= 2 or not 1 <= len(vs) <= 2:
        raise ValueError(f"the paged kernel takes 1 or 2 K and 1 or 2 V caches, got {len(ks)} and {len(vs)}; "
                         "use the gathered path (fusedkv.serving.paged_gathered) for more")
    if len(kw) != len(ks) or len(vw) != len(vs):
        raise ValueError(f"one weight (or None) per cache: {len(ks)} K caches with {len(kw)} weights, "
                         f"{len(vs)} V caches with {len(vw)} weights")
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H_q, D] (one token per sequence), got shape {tuple(q.shape)}")
    ref = ks[0]
    if ref.dim() != 4:
        raise ValueError(f"caches must be [num_blocks, block_size, H_kv, D], got shape {tuple(ref.shape)}")
    for c in (*ks, *vs):
        if c.shape != ref.shape:
            raise ValueError(f"every K/V cache must have one shape; got {[tuple(x.shape) for x in (*ks, *vs)]}")
        if c.stride(-1) != 1:
            raise ValueError("caches must have unit stride in head_dim (vLLM's layout does)")
        if c.device != q.device:
            raise ValueError(f"caches are on {c.device} but q is on {q.device}")
    bsz, h_q, d = q.shape
    _, block_size, h_kv, d_cache = ref.shape
    if d_cache != d:
        raise ValueError(f"q has head_dim {d} but the caches have {d_cache}")
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {d}")
    if h_q % h_kv:
        raise ValueError(f"H_q={h_q} query heads is not a multiple of H_kv={h_kv} kv heads")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if q.dtype not in _SUPPORTED_DTYPES or ref.dtype not in _SUPPORTED_DTYPES + _FP8_CACHE_DTYPES:
        raise ValueError(f"q ({q.dtype}) must be float32, float16 or bfloat16 and the caches ({ref.dtype}) too, or "
                         "float8_e4m3fn / float8_e5m2 (vLLM's fp8 caches viewed as such)")
    if any(c.dtype != ref.dtype for c in (*ks, *vs)):
        raise ValueError(f"every K/V cache must have one dtype; got {sorted({str(c.dtype) for c in (*ks, *vs)})}")
    if block_table.dim() != 2 or block_table.shape[0] < bsz or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must be an int32/int64 [B, max_blocks] tensor with B >= {bsz} rows, "
                         f"got {block_table.dtype} {tuple(block_table.shape)}")
    if seq_lens.dim() != 1 or seq_lens.shape[0] < bsz or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be an int32/int64 [B] tensor with B >= {bsz} entries, "
                         f"got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if block_table.device != q.device or seq_lens.device != q.device:
        raise ValueError(f"block_table ({block_table.device}) and seq_lens ({seq_lens.device}) must be on "
                         f"q's device ({q.device})")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1):
        raise ValueError(f"out must be [B, H_q, D] in q's dtype with unit stride in D, got {out.dtype} "
                         f"{tuple(out.shape)}")
    if window is not None and (isinstance(window, bool) or int(window) != window or window < 1):
        raise ValueError(f"window must be a positive number of keys (or None), got {window!r}")
    if softcap is not None and not softcap >= 0:
        raise ValueError(f"softcap must be positive (or 0 / None: no cap), got {softcap!r}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    kw = [None if w is None else expand_weight(w, h_kv, d).to(q.device).contiguous() for w in kw]
    vw = [None if w is None else expand_weight(w, h_kv, d).to(q.device).contiguous() for w in vw]
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    return paged_decode_step(q, ks, kw, vs, vw, block_table, seq_lens.contiguous(), scale, out=out,
                             max_seq_len=max_seq_len, window=window, softcap=softcap, num_splits=num_splits,
                             block_n=block_n, num_warps=num_warps)


def paged_decode_step(
    q: Tensor,
    ks: list[Tensor],
    kw: list[Tensor | None],
    vs: list[Tensor],
    vw: list[Tensor | None],
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float | None = None,
    *,
    out: Tensor | None = None,
    max_seq_len: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> Tensor:
    """The launch, on arguments already checked (see :func:`paged_decode_attention`): weights None or
    contiguous [H_kv, D] on q's device, block_table with unit stride in its last dim. Reads no device
    value, so a caller that checked once (a serving layer) can launch it under CUDA-graph capture."""
    bsz, h_q, d = q.shape
    block_size, h_kv = ks[0].shape[1], ks[0].shape[2]
    g = h_q // h_kv
    device = q.device
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    s_max = block_table.shape[1] * block_size if max_seq_len is None else max(int(max_seq_len), 1)

    # The same precision choices as triton_decode: exact fp32 products for fp32 (and for bf16 under the
    # interpreter, whose bf16 tl.dot is wrong); tensor-core products in the cache dtype otherwise.
    use_dot = g > 4
    # fp8 caches: widened to fp32 as loaded (no fp8 tensor-core product: the query keeps its precision).
    exact = (ks[0].dtype in (torch.float32, *_FP8_CACHE_DTYPES)
             or (device.type == "cpu" and ks[0].dtype == torch.bfloat16))
    block_g = max(16, triton.next_power_of_2(g)) if use_dot else triton.next_power_of_2(g)
    auto_n, auto_warps = default_launch(d, block_g, use_dot, len(ks) + len(vs))
    if use_dot and exact:
        auto_n = max(16, auto_n // 2)
    block_n = auto_n if block_n is None else int(block_n)
    num_warps = auto_warps if num_warps is None else int(num_warps)
    # The keys a split may visit span at most s_max, or with a window W the last W rounded down to a tile
    # (at most W + block_n - 1): the splits cut that span, not the whole sequence.
    window = int(window) if window else None
    span = s_max if window is None else min(s_max, window + block_n - 1)
    if num_splits is None:
        num_splits = choose_num_splits(span, bsz * h_kv, block_n, _num_sms(device))
    num_splits = max(1, min(int(num_splits), triton.cdiv(span, block_n)))
    # num_splits * chunk >= span: every key the query sees belongs to exactly one split.
    chunk = triton.cdiv(triton.cdiv(span, num_splits), block_n) * block_n

    if out is None:
        out = torch.empty(bsz, h_q, d, dtype=q.dtype, device=device)
    if bsz == 0:
        return out
    single = num_splits == 1
    if single:
        o_part, lse_part, sp, sl = out, out, (0, 0, 0), (0, 0)
    else:
        o_part = torch.empty(bsz, h_q, num_splits, d, dtype=torch.float32, device=device)
        lse_part = torch.empty(bsz, h_q, num_splits, dtype=torch.float32, device=device)
        sp, sl = o_part.stride()[:3], lse_part.stride()[:2]

    k1, v1 = ks[0], vs[0]
    k2 = ks[1] if len(ks) > 1 else k1
    v2 = vs[1] if len(vs) > 1 else v1
    kw1, vw1 = kw[0], vw[0]
    kw2 = kw[1] if len(kw) > 1 else None
    vw2 = vw[1] if len(vw) > 1 else None
    dummy = out  # pointers of disabled features are never dereferenced

    _paged_decode_stage1[(bsz * h_kv, num_splits)](
        q, k1, k2, v1, v2,
        kw1 if kw1 is not None else dummy, kw2 if kw2 is not None else dummy,
        vw1 if vw1 is not None else dummy, vw2 if vw2 is not None else dummy,
        block_table, seq_lens,
        o_part, lse_part, out,
        q.stride(0), q.stride(1),
        k1.stride(0), k1.stride(1), k1.stride(2),
        k2.stride(0), k2.stride(1), k2.stride(2),
        v1.stride(0), v1.stride(1), v1.stride(2),
        v2.stride(0), v2.stride(1), v2.stride(2),
        block_table.stride(0),
        sp[0], sp[1], sp[2],
        sl[0], sl[1],
        out.stride(0), out.stride(1),
        h_kv, g, chunk, scale * _LOG2E, window or 0, float(softcap or 0.0) * _LOG2E,
        HAS_K2=len(ks) > 1, HAS_V2=len(vs) > 1, HAS_WINDOW=window is not None, SOFTCAP=bool(softcap),
        HAS_KW1=kw1 is not None, HAS_KW2=kw2 is not None,
        HAS_VW1=vw1 is not None, HAS_VW2=vw2 is not None,
        SINGLE_SPLIT=single, USE_DOT=use_dot, DOT_PRECISION="ieee" if exact else "default",
        PAGE=block_size, BLOCK_G=block_g, BLOCK_N=block_n, D=d,
        num_warps=num_warps, num_stages=2,
    )
    if not single:
        _merge_splits(o_part, lse_part, out)
    return out
