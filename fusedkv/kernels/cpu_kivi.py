"""Native one-token attention over a KIVI cache, read in place (`cpu_kivi_attention.c`).

The KIVI cache (`fusedkv.quant.kivi`) stores 2/4-bit codes with fp16 scales and zero points (keys per
channel, values per token) and a full-precision residual. Run module by module, each decode step
dequantises every storage layer's whole past into f32 tensors before attending, so the smaller cache is the
slower one. The kernel instead moves the scales onto the query and the probabilities (the products are
linear in the codes) and reads the packed codes directly, with FusedKV's factored fusion (key weights on the
query, value weights on the output, paper Sec. 2.5) over 1-2 sources per side, as `cpu_decode_attention.c`.

It reads a cache reserved for the native step (`KIVICache.reserve`: buffers preallocated for the whole
generation, `fusedkv.quant.kivi.KIVIStore`), described to C once as one `_Row` per batch row and storage
layer (`row_table`). The native decode step (`fusedkv.engine.native_step`) calls it from C; `attention` and
`flush` are the same entry points from Python, for tests and benchmarks.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from . import native
from .cpu_attention import MAX_GROUP, weight_pointers

P, I, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
MAX_HEAD_DIM = 512  # the C kernel's per-head buffers


class Shape(ctypes.Structure):  # `KiviShape` in cpu_kernels.h
    _fields_ = [("bits", I), ("group", I), ("residual", I), ("head_dim", I), ("n_kv_heads", I)]


class _Row(ctypes.Structure):  # `KiviRow` in cpu_kernels.h
    _fields_ = [("k_codes", P), ("k_scale", P), ("k_zero", P), ("k_res", P),
                ("v_codes", P), ("v_scale", P), ("v_zero", P), ("v_res", P), ("k_cap", L), ("v_cap", L)]


def fits(bits: int, group_size: int, residual_length: int, head_dim: int, num_heads: int,
             num_kv_heads: int) -> str | None:
    """Why the kernel cannot take a KIVI cache of these settings, or None when it can (asked once)."""
    per_byte = 8 // bits
    if head_dim > MAX_HEAD_DIM or num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        return f"head_dim {head_dim} > {MAX_HEAD_DIM} or more than {MAX_GROUP} query heads per kv head"
    if group_size % per_byte or residual_length % group_size:
        return f"KIVI group size {group_size} is not a multiple of the {per_byte} codes a byte packs"
    return None


def shape_of(cache) -> Shape:
    """The `KiviShape` of a `KIVICache`."""
    return Shape(cache.bits, cache.group_size, cache.residual_length, cache.head_dim, cache.num_key_value_heads)


def row_table(layer, batch: int) -> ctypes.Array:
    """The `_Row` of each batch row of a reserved `KIVILayer` (a padded layer: its rows' own buffers). The
    pointers stay valid as long as the layer keeps its store (the caller holds the cache)."""
    table = (_Row * batch)()
    for b in range(batch):
        store, row = (layer.rows[b].store, 0) if layer.rows is not None else (layer.store, b)
        if store is None:
            raise ValueError("the KIVI cache is not reserved for the native kernels (KIVICache.reserve)")
        ptrs = [t.data_ptr() + row * t.stride(0) * t.element_size()
                for t in (store.k_codes, store.k_scale, store.k_zero, store.k_res,
                          store.v_codes, store.v_scale, store.v_zero, store.v_res)]
        table[b] = _Row(*ptrs, store.k_codes.shape[2], store.v_codes.shape[2])
    return table


def row_lengths(layer, batch: int) -> torch.Tensor:
    """[B] int64: the tokens each row of a `KIVILayer` holds (padded rows: their own)."""
    if layer.rows is not None:
        return torch.tensor([row.length for row in layer.rows], dtype=torch.int64)
    return torch.full((batch,), layer.length, dtype=torch.int64)


def attention(q: torch.Tensor, cache, k_layers: Sequence[int], k_w: Sequence[torch.Tensor | None],
              v_layers: Sequence[int], v_w: Sequence[torch.Tensor | None], scale: float,
              pending: bool = False) -> torch.Tensor:
    """softmax(q K^T * scale) V over a reserved `KIVICache`, K = sum a_k (.) K_k, V = sum b_v (.) V_v, the
    sources being storage layers of the cache (indices). `q` [B, H_q, 1, D] f32. `pending`: each layer holds
    one token appended (`append`) but not yet counted and flushed (as inside a native step). Returns
    [B, H_q, 1, D] f32."""
    b, h_q, _, d = q.shape
    shape = shape_of(cache)
    k_rows = [row_table(cache.layers[i], b) for i in k_layers]
    v_rows = [row_table(cache.layers[i], b) for i in v_layers]
    kw, vw = weight_pointers(k_w, shape.n_kv_heads, d), weight_pointers(v_w, shape.n_kv_heads, d)
    n = row_lengths(cache.layers[k_layers[0]], b)
    q = q.reshape(b, h_q, d).contiguous()
    out = torch.empty(b, h_q, 1, d)
    status = native.library().kivi_attention(
        q.data_ptr(), b, h_q, shape.n_kv_heads, scale, ctypes.byref(shape),
        len(k_rows), k_rows[0], k_rows[-1], *kw, len(v_rows), v_rows[0], v_rows[-1], *vw,
        n.data_ptr(), int(pending), out.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise ValueError(f"native KIVI attention refused its arguments (status {status})")
    return out


def flush(cache, layer: int, batch: int) -> None:
    """Quantise what left the residual windows of a storage layer whose rows each got one pending token (the
    native step's flush), then count that token."""
    shape, table = shape_of(cache), row_table(cache.layers[layer], batch)
    held = row_lengths(cache.layers[layer], batch)
    for b in range(batch):
        if native.library().kivi_flush(ctypes.byref(shape), ctypes.byref(table[b]), int(held[b])):
            raise ValueError("a K/V group exceeds the fp16 range of KIVI's scales")
    cache.layers[layer].advance(1)


def append(cache, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write one pending token's K / V ([B, H_kv, 1, D]) at the end of a reserved storage layer's residuals,
    as the native step's `kivi_append` does (not yet counted: `flush` does)."""
    kivi = cache.layers[layer]
    for b in range(k.shape[0]):
        store, row, n = ((kivi.rows[b].store, 0, kivi.rows[b].length) if kivi.rows is not None
                         else (kivi.store, b, kivi.length))
        held_k = n - n // cache.residual_length * cache.residual_length
        store.k_res[row, :, held_k] = k[b, :, 0]
        store.v_res[row, :, min(n, cache.residual_length)] = v[b, :, 0]
