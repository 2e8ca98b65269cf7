"""Pure-PyTorch attention over fused (cross-layer) KV sources.

A FusedKV reconstruction layer has no K/V projection of its own.  Its keys and values are a
channel-wise weighted sum of post-RoPE caches of storage layers (paper Sec. 2.2, Eqs. 4-5)::

    K = sum_s a_s (.) K_s          V = sum_s b_s (.) V_s

with ``a_s, b_s`` of shape ``[H_kv, D]`` (a weight of ``None`` means plain reuse, weight 1).

Two implementations with the same signature live here:

* :func:`materialized_attention` builds ``K`` and ``V`` explicitly and calls
  ``scaled_dot_product_attention``.  It is the obviously-correct reference.
* :func:`factored_attention` never writes a fused tensor.  It uses the identity (paper Sec. 2.5)::

      q . (a (.) k1 + b (.) kn) = (a (.) q) . k1 + (b (.) q) . kn
      sum_t p_t (c (.) v1_t + d (.) vn_t) = c (.) (P V1) + d (.) (P Vn)

  so key fusion becomes a (tiny) multiply on the query and value fusion a multiply on the output.
  This is the CPU / fallback path for decode and for short query blocks; the cache is read once per
  use and nothing of size ``S`` is written except the score matrix.

Conventions shared by every function in :mod:`fusedkv.kernels`:

* ``q``: ``[B, H_q, T_q, D]``; sources: ``[B, H_kv, S, D]`` (any strides); ``H_q = G * H_kv`` and query
  head ``h`` uses kv head ``h // G`` (the layout of ``repeat_interleave`` / ``enable_gqa``).
* ``mask``: bool, broadcastable to ``[B, H_q, T_q, S]`` with a head dim of 1 or ``H_q``; True = attend.
  A float mask is accepted as an additive bias.  A query row with no key to attend to returns zeros
  (not NaN): left-padded prompts produce such rows and they must not poison later computations.
* The result has ``q``'s dtype.  Half-precision inputs are computed in float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

__all__ = [
    "normalize_sources",
    "expand_weight",
    "merge_duplicate_sources",
    "fuse_sources",
    "materialized_attention",
    "factored_attention",
    "factored",
    "kv_start_to_mask",
    "weigh_rows",
]


# --------------------------------------------------------------------------------------------------
# Argument normalisation (shared with the Triton wrapper)
# --------------------------------------------------------------------------------------------------
def expand_weight(w: Tensor | None, h_kv: int, d: int) -> Tensor | None:
    """Return a per-(kv_head, channel) weight as ``[H_kv, D]`` (or None).

    The paper allows a weight per channel (``[D]``, shared by the kv heads) or per kv head and
    channel (``[H_kv * D]`` or ``[H_kv, D]``); the kernels only deal with the last form.
    """
    if w is None:
        return None
    if w.dim() == 1 and w.numel() == d:
        return w.unsqueeze(0).expand(h_kv, d)
    if w.numel() == h_kv * d:
        return w.reshape(h_kv, d)
    raise ValueError(f"fusion weight of shape {tuple(w.shape)} does not fit H_kv={h_kv}, D={d}")


def normalize_sources(
    sources: Tensor | Sequence[Tensor], weights: Tensor | Sequence[Tensor | None] | None
) -> tuple[list[Tensor], list[Tensor | None]]:
    """Accept a single tensor or a sequence; ``weights=None`` means every weight is None."""
    if isinstance(sources, Tensor):
        sources = [sources]
        if weights is None or isinstance(weights, Tensor):
            weights = [weights]
    sources = list(sources)
    if not sources:
        raise ValueError("at least one KV source is required")
    if weights is None:
        weights = [None] * len(sources)
    elif isinstance(weights, Tensor):
        raise TypeError("pass one weight per source (a list), not a single tensor for several sources")
    weights = list(weights)
    if len(weights) != len(sources):
        raise ValueError(f"{len(sources)} sources but {len(weights)} weights")
    ref = sources[0]
    for s in sources:
        if s.dim() != 4 or s.shape != ref.shape:
            shapes = [tuple(x.shape) for x in sources]
            raise ValueError(f"all sources must be [B, H_kv, S, D] of one shape; got {shapes}")
    h_kv, d = ref.shape[1], ref.shape[3]
    return sources, [expand_weight(w, h_kv, d) for w in weights]


def merge_duplicate_sources(
    sources: list[Tensor], weights: list[Tensor | None]
) -> tuple[list[Tensor], list[Tensor | None]]:
    """Merge entries that are the *same* tensor: ``a (.) X + b (.) X = (a + b) (.) X``.

    Cheap (weights are [H_kv, D]) and it saves a full read of the cache for such plans; it also
    lets the two-source Triton kernel serve plans that list one tensor several times.
    """
    out_s: list[Tensor] = []
    out_w: list[Tensor | None] = []
    for s, w in zip(sources, weights):
        for i, t in enumerate(out_s):
            if t is s:
                prev = out_w[i]
                dt = torch.float32  # keep fp64 weights fp64 (tests compare at 1e-10)
                for x in (prev, w):
                    if x is not None:
                        dt = torch.promote_types(dt, x.dtype)
                one = torch.ones(s.shape[1], s.shape[3], dtype=dt, device=s.device)
                out_w[i] = (one if prev is None else prev.to(dt)) + (one if w is None else w.to(dt))
                break
        else:
            out_s.append(s)
            out_w.append(w)
    return out_s, out_w


def _as(x: Tensor, dtype: torch.dtype) -> Tensor:
    return x if x.dtype == dtype else x.to(dtype)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp16/bf16 scores lose too much precision for a reference (and bf16 is ~24x slower than fp32 on
    # this project's CPUs), so anything below fp32 is computed in fp32; fp64 stays fp64 for tests.
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _check_q(q: Tensor, src: Tensor) -> tuple[int, int, int, int, int, int]:
    if q.dim() != 4:
        raise ValueError(f"q must be [B, H_q, T_q, D], got {tuple(q.shape)}")
    b, h_q, t_q, d = q.shape
    bs, h_kv, s, ds = src.shape
    if bs != b or ds != d:
        raise ValueError(f"q {tuple(q.shape)} and sources {tuple(src.shape)} disagree on B or D")
    if h_q % h_kv:
        raise ValueError(f"H_q={h_q} is not a multiple of H_kv={h_kv}")
    return b, h_q, t_q, d, h_kv, s


def kv_start_to_mask(kv_start: Tensor | None, s: int, kv_end: Tensor | None = None) -> Tensor | None:
    """Decode-time mask ``[B, 1, 1, S]`` from left-padding starts (and optional valid ends)."""
    if kv_start is None and kv_end is None:
        return None
    ref = kv_start if kv_start is not None else kv_end
    pos = torch.arange(s, device=ref.device)
    m = torch.ones(ref.shape[0], s, dtype=torch.bool, device=ref.device)
    if kv_start is not None:
        m &= pos[None, :] >= kv_start.reshape(-1, 1)
    if kv_end is not None:
        m &= pos[None, :] < kv_end.reshape(-1, 1)
    return m[:, None, None, :]


# --------------------------------------------------------------------------------------------------
# Materialised reference
# --------------------------------------------------------------------------------------------------
def fuse_sources(sources: list[Tensor], weights: list[Tensor | None], dtype: torch.dtype | None = None) -> Tensor:
    """``sum_s w_s (.) X_s`` over ``[B, H_kv, S, D]`` sources with ``[H_kv, D]`` weights (None = 1).

    A single unweighted source in its own dtype is returned as it is (no copy)."""
    if len(sources) == 1 and weights[0] is None and (dtype is None or sources[0].dtype == dtype):
        return sources[0]
    out = None
    for s, w in zip(sources, weights):
        term = s if dtype is None else s.to(dtype)
        if w is not None:
            term = term * w.to(term.dtype)[None, :, None, :]
        out = term if out is None else out + term
    return out


def weigh_rows(x: Tensor, w: Tensor | None) -> Tensor:
    """One side of the factored identity on token rows ``x`` [T, H_q, D]: ``w (.) x`` with ``w`` [H_kv, D] applied
    to each kv head's query heads (a key weight on the queries, a value weight on the outputs); None: ``x``."""
    if w is None:
        return x
    t, h, d = x.shape
    h_kv = w.shape[0]
    return (x.view(t, h_kv, h // h_kv, d) * w[None, :, None, :].to(x.dtype)).view(t, h, d)


def materialized_attention(
    q: Tensor,
    k_sources: Tensor | Sequence[Tensor],
    k_weights: Tensor | Sequence[Tensor | None] | None,
    v_sources: Tensor | Sequence[Tensor],
    v_weights: Tensor | Sequence[Tensor | None] | None,
    mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Reference: build fused K and V, expand kv heads, call SDPA.  Returns ``[B, H_q, T_q, D]``."""
    ks, kw = normalize_sources(k_sources, k_weights)
    vs, vw = normalize_sources(v_sources, v_weights)
    b, h_q, t_q, d, h_kv, s = _check_q(q, ks[0])
    cdt = _compute_dtype(q.dtype)
    k = fuse_sources(ks, kw, cdt)
    v = fuse_sources(vs, vw, cdt)
    g = h_q // h_kv
    if g > 1:
        # repeat_interleave instead of enable_gqa: the plainest possible semantics for a reference.
        k = k.repeat_interleave(g, dim=1)
        v = v.repeat_interleave(g, dim=1)
    attn_mask = None
    if mask is not None:
        attn_mask = mask if mask.dtype == torch.bool else mask.to(cdt)
    out = F.scaled_dot_product_attention(q.to(cdt), k, v, attn_mask=attn_mask, scale=scale)
    if mask is not None and mask.dtype == torch.bool:
        # Rows with nothing to attend to are defined as 0 (backends disagree: NaN or 0).
        has_key = mask.any(dim=-1, keepdim=True).expand(b, h_q, t_q, 1)
        out = torch.where(has_key, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out.to(q.dtype)


# --------------------------------------------------------------------------------------------------
# Factored (fusion-free) path
# --------------------------------------------------------------------------------------------------
def factored_attention(
    q: Tensor,
    k_sources: Tensor | Sequence[Tensor],
    k_weights: Tensor | Sequence[Tensor | None] | None,
    v_sources: Tensor | Sequence[Tensor],
    v_weights: Tensor | Sequence[Tensor | None] | None,
    mask: Tensor | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Attention over fused sources without writing the fused K or V.

    scores = sum_s (q (.) a_s) @ K_s^T ;  out = sum_s b_s (.) (softmax(scores) @ V_s).
    `softcap`: Gemma 2's attention logit soft-capping, scores -> c tanh(scores / c) after the scale (the fused
    scores are formed first, so capping them is the same as capping the materialised fused K's).

    GQA: ``q`` is viewed as ``[B, H_kv, G*T_q, D]`` (query heads of one kv head are adjacent), so each
    ``K_s`` / ``V_s`` is used by a batched matmul as it is, without ``repeat_interleave``: the grouped
    queries simply become extra rows of one GEMM per (batch, kv head).
    """
    ks, kw = normalize_sources(k_sources, k_weights)
    vs, vw = normalize_sources(v_sources, v_weights)
    _check_q(q, ks[0])
    if vs[0].shape != ks[0].shape:
        raise ValueError("K and V sources must have the same shape")
    ks, kw = merge_duplicate_sources(ks, kw)
    vs, vw = merge_duplicate_sources(vs, vw)
    return factored(q, ks, kw, vs, vw, mask, scale, softcap)


def factored(q: Tensor, ks: Sequence[Tensor], kw: Sequence[Tensor | None], vs: Sequence[Tensor],
             vw: Sequence[Tensor | None], mask: Tensor | None, scale: float | None,
             softcap: float | None = None) -> Tensor:
    """:func:`factored_attention` on arguments already in its form (distinct [B, H_kv, S, D] sources of one
    shape, [H_kv, D] weights or None), with no checks: for callers whose sources are built in that form
    (the attention layers' `KVSources`)."""
    b, h_q, t_q, d = q.shape
    h_kv, s = ks[0].shape[1], ks[0].shape[2]
    g = h_q // h_kv
    cdt = _compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(d) if scale is None else scale

    # [B, H_q, T_q, D] -> [B, H_kv, G*T_q, D]: a view when q is contiguous.  The softmax scale is
    # folded into q here (D multiplies per row instead of S).
    qg = _as(q.reshape(b, h_kv, g * t_q, d), cdt) * scale

    # Query-side key fusion: one [H_kv, D] multiply per source, then one batched GEMM per source.
    # (`_as` skips no-op dtype casts: at one decode token this function's cost is mostly op calls.)
    scores = None
    for src, w in zip(ks, kw):
        qs = qg if w is None else qg * _as(w, cdt).unsqueeze(1)  # [H_kv, 1, D] over [B, H_kv, G*T_q, D]
        kt = _as(src, cdt).transpose(-1, -2)  # a view for fp32/fp64 sources: no copy of the cache
        if scores is None:
            scores = torch.matmul(qs, kt)
        else:
            scores.add_(torch.matmul(qs, kt))  # in place: one score buffer for every source
    if softcap:
        scores = torch.tanh(scores / softcap).mul_(softcap)

    # Mask (bool -> -inf, float -> additive) in the grouped layout [B, H_kv, G, T_q, S].
    row_ok = None
    if mask is not None:
        m = mask
        while m.dim() < 4:
            m = m.unsqueeze(0)
        mh = m.shape[1]
        if mh == 1:
            m5 = m.unsqueeze(1)  # [B?, 1, 1, T?, S]
        elif mh == h_q:
            m5 = m.reshape(m.shape[0], h_kv, g, m.shape[2], m.shape[3])
        else:
            raise ValueError(f"mask head dim must be 1 or H_q={h_q}, got {mh}")
        s5 = scores.view(b, h_kv, g, t_q, s)
        if m5.dtype == torch.bool:
            s5.masked_fill_(~m5, float("-inf"))
            row_ok = m5.any(dim=-1, keepdim=True)
        else:
            s5.add_(m5.to(cdt))

    p = torch.softmax(scores, dim=-1)
    if row_ok is not None:
        # Fully masked rows: softmax gives NaN; defined as zero output.
        p5 = p.view(b, h_kv, g, t_q, s)
        p5.masked_fill_(~row_ok, 0.0)

    # Output-side value fusion: out = sum_s b_s (.) (P @ V_s).
    out = None
    for src, w in zip(vs, vw):
        pv = torch.matmul(p, _as(src, cdt))
        if w is not None:
            pv.mul_(_as(w, cdt).unsqueeze(1))
        out = pv if out is None else out.add_(pv)
    return _as(out.reshape(b, h_q, t_q, d), q.dtype)
