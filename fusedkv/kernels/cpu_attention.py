"""Native one-token attention over the KV cache for CPU decoding (`cpu_decode_attention.c`).

The CPU counterpart of the Triton decode kernel: the factored form of paper Sec. 2.5 (key fusion
weights on the query, value weights on the output) over 1-2 key and 1-2 value sources read in place,
GQA with one read of each kv head for the query heads that share it, left padding as a first key per
row, and the cache read in its own element type (f32, bf16 or f16, widened as read), so a 16-bit cache
needs no f32 copy. Over a plain f32 cache it is as fast as PyTorch's CPU SDPA at one query row; it
replaces the factored PyTorch path of weighted layers (several ops per step) and the f32 copy that SDPA
needs over a 16-bit cache, where SDPA is several times slower (`benchmarks/cpu_decode.py`; figures in
`docs/cpu-decode.md`). Built and loaded by `fusedkv.kernels.native`. What it takes is decided once, by
the engine's selection (`fusedkv.engine.select_runtime`, from `fits`); `one_token_attention` then only
launches it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import native

KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_GROUP = 64  # query heads per kv head (the C kernel's bound)


def fits(head_dim: int, num_heads: int, num_kv_heads: int, k_count: int, v_count: int) -> bool:
    """Whether the kernel takes a layer of this shape (asked once per layer, by the engine's selection)."""
    return (1 <= k_count <= 2 and 1 <= v_count <= 2 and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GROUP)


def weight_pointers(weights: Sequence[torch.Tensor | None], h_kv: int,
                    d: int) -> tuple[int | None, int | None, int]:
    """Pointers to 1-2 f32 weights and the elements between kv heads (0: one [D] weight for every head).
    A weight in another form is a caller's error (the selection admits per-channel f32 weights only)."""
    ptrs, head_stride = [None, None], 0
    for i, w in enumerate(weights):
        if w is None:
            continue
        stride = 0 if w.numel() == d else d
        if (w.dtype != torch.float32 or not w.is_contiguous() or w.numel() not in (d, h_kv * d)
                or ptrs[0] is not None and stride != head_stride):
            raise ValueError(f"fusion weight {tuple(w.shape)} {w.dtype}: the native kernel reads contiguous f32 "
                             f"[{h_kv}, {d}] or [{d}] weights")
        ptrs[i], head_stride = w.data_ptr(), stride
    return ptrs[0], ptrs[1], head_stride


def one_token_attention(q: torch.Tensor, k_src: Sequence[torch.Tensor], k_w: Sequence[torch.Tensor | None],
                     v_src: Sequence[torch.Tensor], v_w: Sequence[torch.Tensor | None],
                     kv_start: torch.Tensor | None, scale: float) -> torch.Tensor:
    """softmax(q K^T * scale) V for one query token per row, K = sum a_k (.) K_k, V = sum b_v (.) V_v
    (weights contiguous f32 [H_kv, D] or [D], None for 1), keys from `kv_start[b]` on. `q` [B, H_q, 1, D] f32
    on CPU; 1-2 sources per side, [B, H_kv, S, D] of one dtype (f32, bf16, f16) and one stride per side, unit
    stride along D. Returns [B, H_q, 1, D] f32. The caller has decided that the kernel takes these
    (`fits`, with the native kernels built): nothing is checked again here."""
    b, h_q, _, d = q.shape
    k0, v0 = k_src[0], v_src[0]
    h_kv, length = k0.shape[1], k0.shape[2]
    kw, vw = weight_pointers(k_w, h_kv, d), weight_pointers(v_w, h_kv, d)
    q = q.reshape(b, h_q, d).contiguous()
    out = torch.empty(b, h_q, 1, d)
    start = None if kv_start is None else kv_start.to(torch.int64).contiguous()
    status = native.library().decode_attention(
        q.data_ptr(), b, h_q, h_kv, d, length, scale, KINDS[k0.dtype],
        len(k_src), k0.data_ptr(), k_src[-1].data_ptr(), *k0.stride()[:3], *kw,
        len(v_src), v0.data_ptr(), v_src[-1].data_ptr(), *v0.stride()[:3], *vw,
        None if start is None else start.data_ptr(), out.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise MemoryError("native decode attention could not allocate its score buffer")
    return out
