"""Native one-token attention over the KV cache for CPU decoding (`cpu_decode_attention.c`).

The CPU counterpart of the Triton decode kernel: the factored form of paper Sec. 2.5 (key fusion
weights on the query, value weights on the output) over 1-2 key and 1-2 value sources read in place,
GQA with one read of each kv head for the query heads that share it, left padding as a first key per
row, and the cache read in its own element type (f32, bf16 or f16, widened as read), so a 16-bit cache
needs no f32 copy. Over a plain f32 cache it is as fast as PyTorch's CPU SDPA at one query row; it
replaces the factored PyTorch path of weighted layers (several ops per step) and the f32 copy that SDPA
needs over a 16-bit cache, where SDPA is several times slower (`benchmarks/cpu_decode.py`; figures in
`docs/cpu-decode.md`). Built and loaded by `fusedkv.kernels.native`; `decode_attention` declines (returns
None) whatever it does not cover, and the caller runs its PyTorch path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import native

KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_GROUP = 64  # query heads per kv head (the C kernel's bound)


def supports(head_dim: int, num_heads: int, num_kv_heads: int, k_count: int, v_count: int) -> bool:
    """Whether the kernel takes a layer of this shape (decided once, when the layer is built)."""
    return (1 <= k_count <= 2 and 1 <= v_count <= 2 and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GROUP)


def weight_pointers(weights: Sequence[torch.Tensor | None], h_kv: int,
                    d: int) -> tuple[int | None, int | None, int] | None:
    """Pointers to 1-2 f32 weights and the elements between kv heads (0: one [D] weight for every head);
    None when they are not in a form the kernel reads in place."""
    ptrs, head_stride = [None, None], 0
    for i, w in enumerate(weights):
        if w is None:
            continue
        if w.dtype != torch.float32 or not w.is_contiguous() or w.numel() not in (d, h_kv * d):
            return None
        stride = 0 if w.numel() == d else d
        if ptrs[0] is not None and stride != head_stride:
            return None
        ptrs[i], head_stride = w.data_ptr(), stride
    return ptrs[0], ptrs[1], head_stride


def decode_attention(q: torch.Tensor, k_src: Sequence[torch.Tensor], k_w: Sequence[torch.Tensor | None],
                     v_src: Sequence[torch.Tensor], v_w: Sequence[torch.Tensor | None],
                     kv_start: torch.Tensor | None, scale: float) -> torch.Tensor | None:
    """softmax(q K^T * scale) V for one query token per row, K = sum a_k (.) K_k, V = sum b_v (.) V_v
    (weights [H_kv, D] or [H_kv * D], None for 1), keys from `kv_start[b]` on. `q` [B, H_q, 1, D] f32;
    sources [B, H_kv, S, D] of one dtype (f32, bf16, f16) with unit stride along D. Returns [B, H_q, 1, D]
    f32, or None where the kernel does not apply."""
    b, h_q, t, d = q.shape
    if (t != 1 or q.dtype != torch.float32 or q.device.type != "cpu" or not native.available()
            or torch.compiler.is_compiling()):
        return None
    sources = [*k_src, *v_src]
    kind = KINDS.get(sources[0].dtype)
    if kind is None or any(s.dtype != sources[0].dtype or s.stride(3) != 1 or s.device.type != "cpu"
                           for s in sources):
        return None
    h_kv, length = sources[0].shape[1], sources[0].shape[2]
    if any(s.stride() != k_src[0].stride() for s in k_src) or any(s.stride() != v_src[0].stride() for s in v_src):
        return None
    kw, vw = weight_pointers(k_w, h_kv, d), weight_pointers(v_w, h_kv, d)
    if kw is None or vw is None:
        return None
    q = q.reshape(b, h_q, d).contiguous()
    out = torch.empty(b, h_q, 1, d)
    start = None if kv_start is None else kv_start.to(torch.int64).contiguous()
    k0, v0 = k_src[0], v_src[0]
    status = native.library().decode_attention(
        q.data_ptr(), b, h_q, h_kv, d, length, scale, kind,
        len(k_src), k0.data_ptr(), k_src[-1].data_ptr(), *k0.stride()[:3], *kw,
        len(v_src), v0.data_ptr(), v_src[-1].data_ptr(), *v0.stride()[:3], *vw,
        None if start is None else start.data_ptr(), out.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise MemoryError("native decode attention could not allocate its score buffer")
    return out
