"""An 8-bit floating-point KV cache for scoring: what a model sees when an engine keeps its cache in fp8.

vLLM's `--kv-cache-dtype fp8` stores keys and values as float8 e4m3 with one scale per layer for K and one
for V (1.0 unless the checkpoint carries calibrated scales); each read dequantises `code * scale`.
`FP8Cache` holds exactly those rounded values for the plan's storage layers (kept dequantised in the model's
dtype: this cache is for measuring quality token by token with `fusedkv.quant.scoring.DecodeScorer`, and
its `bytes_per_element` is what the engine stores, one byte). Values beyond e4m3's range saturate at
+-448, as vLLM's conversion kernels do; reconstruction layers read the rounded storage, as in the engine.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from .storage import StorageLayersCache

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


def fp8_round_trip(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """`x` as an e4m3 cache returns it: x / scale saturated to the format's range, rounded to e4m3, times
    scale, in x's dtype."""
    codes = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (codes.float() * scale).to(x.dtype)


class FP8Layer(DynamicLayer):
    """A storage layer whose keys and values are rounded to e4m3 (per-layer scales) as they are stored."""

    def __init__(self, k_scale: float = 1.0, v_scale: float = 1.0):
        super().__init__()
        self.k_scale, self.v_scale = k_scale, v_scale

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return super().update(fp8_round_trip(key_states, self.k_scale), fp8_round_trip(value_states, self.v_scale),
                              *args, **kwargs)


class FP8Cache(StorageLayersCache):
    """A transformers `Cache` with an `FP8Layer` for each of the plan's storage layers (reconstruction layers hold
    nothing and read the storage layers' rounded K/V)."""

    bytes_per_element = 1

    def __init__(self, config, k_scale: float = 1.0, v_scale: float = 1.0):
        super().__init__(config, lambda: FP8Layer(k_scale, v_scale))
