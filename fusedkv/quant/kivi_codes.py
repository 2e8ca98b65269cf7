"""KIVI's quantisation arithmetic (Liu et al. 2024, Algorithm 1): keys per channel in groups of G tokens, values
per token in groups of G channels, asymmetric min/max with fp16 scales and zeros, codes bit-packed along the
channel axis in uint8; the settings it takes, and the closed-form bytes of a cache that holds them. The cache
that applies it to a model's storage layers (residual window, flushes, padding) is `fusedkv.quant.kivi`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_BITS = (2, 4)
DEFAULT_GROUP_SIZE = 32  # KIVI's G and the FusedKV paper's setting
DEFAULT_RESIDUAL_LENGTH = 128  # KIVI's R
SCALE_DTYPE = torch.float16  # scales and zero points: 16 bits each


def default_group_size(head_dim: int, residual_length: int = DEFAULT_RESIDUAL_LENGTH) -> int:
    """The group size G a model gets when none is given: KIVI's 32 when it fits, else the largest smaller
    size that divides both the head dimension (values are grouped along channels) and the residual length
    (keys are quantised a whole group at a time): 32 for head_dim 64 or 128, 16 for head_dim 48 (the
    default `fusedkv train` model), 8 for head_dim 40."""
    common = math.gcd(head_dim, residual_length)
    return max(g for g in range(1, DEFAULT_GROUP_SIZE + 1) if common % g == 0)


def check_kivi_settings(bits: int, group_size: int, residual_length: int, head_dim: int | None = None) -> None:
    """Raise a one-line ValueError for settings the scheme cannot take."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"KIVI supports {' or '.join(map(str, SUPPORTED_BITS))} bits, got {bits}; "
                         "use --kv-bits 2 or 4")
    if group_size < 1:
        raise ValueError(f"KIVI group size must be a positive number of tokens/channels, got {group_size}")
    if head_dim is not None and head_dim % group_size:
        raise ValueError(f"KIVI group size {group_size} does not divide the head dimension {head_dim} "
                         "(values are grouped along channels); pick a divisor of the head dimension")
    if head_dim is not None and head_dim % (8 // bits):
        raise ValueError(f"head dimension {head_dim} cannot be packed {8 // bits} codes per byte at {bits} bits")
    if residual_length < group_size or residual_length % group_size:
        raise ValueError(f"KIVI residual length {residual_length} must be a positive multiple of the group size "
                         f"{group_size} (keys are quantised a whole group at a time)")


# --- packing ------------------------------------------------------------------------------------


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes < 2**bits, [..., D] -> [..., D * bits / 8]: 8 / bits codes per byte, the channels split into
    8 / bits consecutive parts of D * bits / 8, byte i holding channel i of each, the first part in the lowest
    bits (as llama.cpp's Q4_0 puts a block's first half in the low nibbles): a native kernel then reads one
    part of the query against one bit field of contiguous bytes (`fusedkv/kernels/cpu_kivi_attention.c`)."""
    per_byte = 8 // bits
    parts = codes.reshape(*codes.shape[:-1], per_byte, codes.shape[-1] // per_byte)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device).unsqueeze(-1)
    return (parts << shifts).sum(-2, dtype=torch.uint8)  # disjoint bit fields: the sum is a bitwise or


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `pack_codes`."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device).unsqueeze(-1)
    codes = (packed.unsqueeze(-2) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * (8 // bits))


# --- the quantiser ------------------------------------------------------------------------------


@dataclass
class QuantizedKV:
    """One quantised K or V block, [B, H, T, D] logically. `axis` is "channel" (keys: scale/zero
    [B, H, T/G, D], one per channel per group of G tokens) or "token" (values: [B, H, T, D/G], one
    per group of G channels per token). Blocks of the same axis concatenate along dim 2."""

    packed: torch.Tensor  # uint8 [B, H, T, D * bits / 8]
    scale: torch.Tensor  # fp16
    zero: torch.Tensor  # fp16
    bits: int
    group_size: int
    axis: str

    @property
    def num_tokens(self) -> int:
        return self.packed.shape[2]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.packed, self.scale, self.zero

    def cat(self, other: QuantizedKV) -> QuantizedKV:
        return QuantizedKV(*(torch.cat([a, b], dim=2) for a, b in zip(self.tensors(), other.tensors())),
                           self.bits, self.group_size, self.axis)

    def index_select(self, batch_idx: torch.Tensor) -> QuantizedKV:
        return QuantizedKV(*(t.index_select(0, batch_idx) for t in self.tensors()), self.bits, self.group_size,
                           self.axis)


def _min_max_quantize(x: torch.Tensor, bits: int, dim: int):
    """Asymmetric min/max quantisation of `x` with one (scale, zero) per slice reduced over `dim`.
    Codes are computed against the fp16-rounded scale and zero, i.e. the ones dequantisation uses."""
    qmax = (1 << bits) - 1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = ((hi - lo) / qmax).to(SCALE_DTYPE)
    zero = lo.to(SCALE_DTYPE)
    if not bool(torch.isfinite(scale).all() and torch.isfinite(zero).all()):
        raise ValueError("a K/V group exceeds the fp16 range of KIVI's scales; quantise a model whose K/V fit fp16")
    s, z = scale.to(x.dtype), zero.to(x.dtype)
    codes = ((x - z) / torch.where(s > 0, s, torch.ones_like(s))).round_().clamp_(0, qmax).to(torch.uint8)
    return codes, scale, zero


def quantize_keys(k: torch.Tensor, bits: int, group_size: int) -> QuantizedKV:
    """Per-channel quantisation of keys [B, H, T, D], T a multiple of G (KIVI Sec. 3)."""
    b, h, t, d = k.shape
    if t % group_size:
        raise ValueError(f"per-channel key quantisation needs whole groups: {t} tokens, group size {group_size}")
    codes, scale, zero = _min_max_quantize(k.reshape(b, h, t // group_size, group_size, d), bits, dim=3)
    return QuantizedKV(pack_codes(codes.reshape(b, h, t, d), bits), scale.squeeze(3), zero.squeeze(3),
                       bits, group_size, "channel")


def quantize_values(v: torch.Tensor, bits: int, group_size: int) -> QuantizedKV:
    """Per-token quantisation of values [B, H, T, D] in groups of G channels (KIVI Sec. 3)."""
    b, h, t, d = v.shape
    if d % group_size:
        raise ValueError(f"group size {group_size} does not divide the head dimension {d}")
    codes, scale, zero = _min_max_quantize(v.reshape(b, h, t, d // group_size, group_size), bits, dim=4)
    return QuantizedKV(pack_codes(codes.reshape(b, h, t, d), bits), scale.squeeze(4), zero.squeeze(4),
                       bits, group_size, "token")


def dequantize(q: QuantizedKV, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[B, H, T, D] in `dtype`: code * scale + zero, with each group's scale and zero broadcast."""
    codes = unpack_codes(q.packed, q.bits).to(dtype)
    b, h, t, d = codes.shape
    g = q.group_size
    if q.axis == "channel":
        grouped = codes.view(b, h, t // g, g, d)
        out = grouped * q.scale.to(dtype).unsqueeze(3) + q.zero.to(dtype).unsqueeze(3)
    else:
        grouped = codes.view(b, h, t, d // g, g)
        out = grouped * q.scale.to(dtype).unsqueeze(4) + q.zero.to(dtype).unsqueeze(4)
    return out.reshape(b, h, t, d)


def fake_quantize(x: torch.Tensor, bits: int, group_size: int, axis: str) -> torch.Tensor:
    """Quantise then dequantise (for references and error measurements)."""
    q = quantize_keys(x, bits, group_size) if axis == "channel" else quantize_values(x, bits, group_size)
    return dequantize(q, x.dtype)


def quantized_token_counts(num_tokens: int, residual_length: int) -> tuple[int, int]:
    """(key tokens, value tokens) held quantised once `num_tokens` tokens have been stored and
    flushed: keys in whole windows of R, values all but the last R (KIVI Algorithm 1)."""
    return (num_tokens // residual_length) * residual_length, max(num_tokens - residual_length, 0)


def kivi_layer_nbytes(num_tokens: int, batch: int, kv_heads: int, head_dim: int, bits: int, group_size: int,
                      residual_length: int, residual_bytes: int) -> int:
    """Closed-form bytes of one storage layer's KIVI cache after `num_tokens` tokens.
    `residual_bytes`: bytes per full-precision element (the model dtype)."""
    qk, qv = quantized_token_counts(num_tokens, residual_length)
    meta = 2 * SCALE_DTYPE.itemsize  # one scale and one zero
    key_bytes = (qk * head_dim * bits // 8 + (qk // group_size) * head_dim * meta
                 + (num_tokens - qk) * head_dim * residual_bytes)
    value_bytes = (qv * head_dim * bits // 8 + qv * (head_dim // group_size) * meta
                   + (num_tokens - qv) * head_dim * residual_bytes)
    return batch * kv_heads * (key_bytes + value_bytes)


def kivi_cache_nbytes(config, num_tokens: int, batch: int, bits: int, group_size: int = DEFAULT_GROUP_SIZE,
                      residual_length: int = DEFAULT_RESIDUAL_LENGTH, residual_bytes: int = 4) -> int:
    """Closed-form bytes of a `KIVICache` for a model config: only the plan's storage layers count."""
    per_layer = kivi_layer_nbytes(num_tokens, batch, config.num_key_value_heads, config.head_dim, bits, group_size,
                                  residual_length, residual_bytes)
    return per_layer * len(config.plan.storage_layers)


def kivi_bytes_per_token(head_dim: int, bits: int, group_size: int, meta_bytes: int = 2) -> float:
    """Asymptotic bytes per token per KV head per storage layer (K and V, residual window ignored):
    packed codes plus one 16-bit scale and zero per G elements."""
    return 2 * head_dim * (bits / 8 + 2 * meta_bytes / group_size)
