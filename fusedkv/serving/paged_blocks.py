"""How vLLM's paged KV-cache blocks are laid out and read: each backend's cache tensor split into its key and
value caches as that backend splits it, the CPU backend's block layout, and a sequence's blocks gathered into
token order. The attention over these caches: `fusedkv.serving.paged`.

The CPU backend stores blocks in its own layout, which depends on the ISA it picks (the "vec" ISA keeps each key
block transposed, [head_dim, block]; the "amx" ISA, bf16 caches on processors with AMX, packs keys and values in
pairs: `AMX_PACKED_KEYS`, `AMX_PACKED_VALUES`). `block_layout` learns the layout from the backend's own
cache-write op instead of assuming it: the layout is the op's to choose, and a wrong assumption reads wrong keys
without any error. Learned, the gather is right for every ISA the op has (a layout with no name here is read by
index), and the layouts the native kernel reads are recognised by name (`KERNEL_LAYOUTS`).

vLLM's GPU backends (FlashAttention, Triton: `GPU_PAGED_IMPLS`) use one layout, [num_blocks, block_size, H_kv, D]
views of their [num_blocks, H_kv, block_size, 2 * D] tensor (`split_gpu_kv_cache`, `gather_paged`).
"""

from __future__ import annotations

import functools

import torch

from ..kernels import native

# vLLM's 8-bit KV caches (`--kv-cache-dtype`): uint8 tensors holding the fp8 codes of x / scale, with one float
# scale per attention layer for its keys and one for its values (`layer._k_scale_float`, `_v_scale_float`: 1.0
# unless the checkpoint carries scales). "fp8" is e4m3 (vLLM's CPU kernels dispatch it as "fp8_e4m3"). The
# reconstruction layers read the codes as these dtypes (free views) and fold the scales into their fusion weights.
FP8_FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def cache_element_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a layer's cache elements are read as: the model's (`auto`), the one named, or an fp8 format."""
    if kv_cache_dtype == "auto":
        return model_dtype
    return FP8_FORMATS.get(kv_cache_dtype) or getattr(torch, kv_cache_dtype)


def quantize_fp8(x: torch.Tensor, fmt: torch.dtype, scale: float) -> torch.Tensor:
    """x as vLLM writes it to an 8-bit cache: fp8(x / scale), rounded to nearest even and saturated at the
    format's largest finite value (vLLM's conversion saturates; torch's cast alone would give NaN/inf)."""
    limit = torch.finfo(fmt).max
    return (x.float() / scale).clamp(-limit, limit).to(fmt)


def dequantize_fp8(codes: torch.Tensor, scale: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What vLLM's attention reads from an 8-bit cache: code * scale."""
    return (codes.to(torch.float32) * scale).to(dtype)


def split_cpu_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[blocks, kv_heads, block, 2*D] -> key cache, value cache, each [blocks, kv_heads, block, D] (views),
    exactly as vLLM's CPU backend splits it."""
    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    return kv_cache.view(num_blocks, num_kv_heads, block_size * 2, -1).chunk(2, dim=2)


@functools.lru_cache(maxsize=16)
def block_layout(isa: str, dtype: torch.dtype, block_size: int, head_dim: int,
                 kv_cache_dtype: str = "auto") -> tuple[torch.Tensor | None, ...]:
    """Where the CPU backend puts element (token t, channel d) of one (block, head) of the key and of
    the value cache: index tensors `idx` with plain[t * D + d] = raw[idx[t * D + d]] (None = plain).

    Learned by writing position codes through vLLM's `cpu_attn_reshape_and_cache` into a scratch cache
    of one block and one head. Codes are written in base-64 digits, exact in every cache dtype (an 8-bit cache,
    `dtype` its fp8 format: base-8 digits, exact in e4m3 and e5m2, written from float32 rows with scale 1)."""
    from vllm import _custom_ops as ops

    n = block_size * head_dim
    fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    base, digits = (8 if fp8 else 64), 1
    while base**digits < n:
        digits += 1
    codes = torch.arange(n)
    found = [torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)]
    for k in range(digits):
        digit = (codes // base**k) % base
        tokens = digit.view(block_size, 1, head_dim).to(torch.float32 if fp8 else dtype)  # [T, H=1, D]: slot t
        kv = torch.zeros(1, 1, block_size, 2 * head_dim, dtype=torch.uint8 if fp8 else dtype)
        key_cache, value_cache = split_cpu_kv_cache(kv)
        ops.cpu_attn_reshape_and_cache(tokens, tokens.clone(), key_cache, value_cache,
                                       torch.arange(block_size), isa, kv_cache_dtype=kv_cache_dtype)
        for side, cache in enumerate((key_cache, value_cache)):
            found[side] += (cache.view(dtype) if fp8 else cache)[0, 0].reshape(-1).to(torch.long) * base**k
    layout = []
    for raw_codes in found:
        # raw position p holds code raw_codes[p]; invert to: code c sits at position idx[c].
        if not torch.equal(torch.sort(raw_codes).values, codes):
            raise RuntimeError(f"vLLM's CPU cache layout for isa={isa!r} is not a permutation of one block; "
                               "the gathered attention path cannot read it")
        idx = torch.empty(n, dtype=torch.long)
        idx[raw_codes] = torch.arange(n)
        named = [name for name in (TRANSPOSED, AMX_PACKED_KEYS, AMX_PACKED_VALUES)
                 if torch.equal(idx, layout_index(name, block_size, head_dim))]
        layout.append(None if torch.equal(idx, codes) else named[0] if named else idx)
    return tuple(layout)


# The block layouts with names (`block_layout`); where (token t, channel d) of one (block, head) of bs tokens
# and D channels sits in it: `layout_index`.
TRANSPOSED = "transposed"  # [D, bs]: the "vec" ISA's key layout
AMX_PACKED_KEYS = "amx-packed keys"  # [bs/16][D/2][16 tokens][2 channels]: the "amx" ISA's keys (AMX B tiles)
AMX_PACKED_VALUES = "amx-packed values"  # [D/16][bs/2][16 channels][2 tokens]: the "amx" ISA's values
# The (key, value) layouts the native kernel reads, by its names for them.
KERNEL_LAYOUTS = {(None, None): native.PAGED_ROWS, (TRANSPOSED, None): native.PAGED_KEYS_TRANSPOSED,
                  (AMX_PACKED_KEYS, AMX_PACKED_VALUES): native.PAGED_AMX}


def layout_index(name: str, block_size: int, head_dim: int) -> torch.Tensor | None:
    """A named layout as `block_layout`'s index (raw position of element t * D + d), or None where the name has
    no such layout at this shape (the AMX packings take blocks and heads of multiples of 16)."""
    t = torch.arange(block_size)[:, None]
    d = torch.arange(head_dim)[None, :]
    if name == TRANSPOSED:
        return (d * block_size + t).reshape(-1)
    if block_size % 16 or head_dim % 16:
        return None
    if name == AMX_PACKED_KEYS:
        return ((t // 16) * (16 * head_dim) + (d // 2) * 32 + (t % 16) * 2 + d % 2).reshape(-1)
    if name == AMX_PACKED_VALUES:
        return ((d // 16) * (16 * block_size) + (t // 2) * 32 + (d % 16) * 2 + t % 2).reshape(-1)
    raise ValueError(f"no block layout named {name!r}")


def kernel_layout(layout: tuple) -> int | None:
    """The native kernel's name (`native.PAGED_LAYOUTS`) for a (key, value) layout from `block_layout`, None where
    the kernel does not read it."""
    if any(isinstance(side, torch.Tensor) for side in layout):  # a general index: not one the kernel has
        return None
    return KERNEL_LAYOUTS.get(tuple(layout))


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, layout) -> torch.Tensor:
    """Blocks [R, n] of a [num_blocks, H, bs, D] cache -> [R, H, n * bs, D] in token order (a strided
    view of one copy for the plain and transposed layouts)."""
    r, n = blocks.shape
    num_blocks, h, bs, d = cache.shape
    if layout is None:  # [H, R, n, bs, D]: one copy; the result is a view of it
        return cache.transpose(0, 1)[:, blocks].view(h, r, n * bs, d).transpose(0, 1)
    if layout == TRANSPOSED:  # [H, R, n, D, bs] copy, then tokens to the front
        x = cache.view(num_blocks, h, d, bs).transpose(0, 1)[:, blocks]
        return x.permute(1, 0, 2, 4, 3).reshape(r, h, n * bs, d)
    if layout == AMX_PACKED_KEYS:  # raw [bs/16, D/2, 16, 2] holds (t // 16, d // 2, t % 16, d % 2)
        x = cache[blocks.reshape(-1)].view(r, n, h, bs // 16, d // 2, 16, 2)
        return x.permute(0, 2, 1, 3, 5, 4, 6).reshape(r, h, n * bs, d)
    if layout == AMX_PACKED_VALUES:  # raw [D/16, bs/2, 16, 2] holds (d // 16, t // 2, d % 16, t % 2)
        x = cache[blocks.reshape(-1)].view(r, n, h, d // 16, bs // 2, 16, 2)
        return x.permute(0, 2, 1, 4, 6, 3, 5).reshape(r, h, n * bs, d)
    x = cache[blocks.reshape(-1)].reshape(r * n, h, bs * d).index_select(-1, layout)
    return x.view(r, n, h, bs, d).permute(0, 2, 1, 3, 4).reshape(r, h, n * bs, d)


def cpu_cache_layout(model_dtype: torch.dtype, cache_dtype: torch.dtype, kv_cache_dtype: str, block_size: int,
                     head_dim: int) -> tuple:
    """The CPU backend's key and value block layouts for these caches, from the ISA its metadata builder will
    pick (the same vLLM function, on the same configuration)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return block_layout(_get_attn_isa(model_dtype, block_size, head_dim, kv_cache_dtype), cache_dtype, block_size,
                        head_dim, kv_cache_dtype if kv_cache_dtype in FP8_FORMATS else "auto")


# ---- GPU backends: caches [num_blocks, block_size, H_kv, D] --------------------------------------------
GPU_PAGED_IMPLS = ("FlashAttentionImpl", "TritonAttentionImpl")  # backends whose caches split as below


def split_gpu_kv_cache(kv_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's FlashAttention / Triton backend cache [num_blocks, H_kv, block_size, 2*D] -> key cache, value
    cache, each [num_blocks, block_size, H_kv, D] (strided views), exactly as those backends split it."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_dim, dim=-1)
    return key_cache, value_cache


def gather_paged(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Blocks [R, n] of a [num_blocks, block_size, H_kv, D] cache -> [R, H_kv, n * block_size, D] in token
    order (one copy)."""
    r, n = blocks.shape
    _, bs, h, d = cache.shape
    return cache[blocks.reshape(-1)].reshape(r, n * bs, h, d).transpose(1, 2)
