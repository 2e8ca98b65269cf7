"""KV-cache quantisation: KIVI's 2/4-bit per-channel keys / per-token values with a full-precision
residual window (`fusedkv.quant.kivi`, its arithmetic in `kivi_codes`), as a transformers `Cache` for every plan."""

from .kivi import KIVICache, kivi_cache_factory
from .kivi_codes import (
    DEFAULT_GROUP_SIZE,
    DEFAULT_RESIDUAL_LENGTH,
    check_kivi_settings,
    default_group_size,
    dequantize,
    fake_quantize,
    kivi_bytes_per_token,
    kivi_cache_nbytes,
    quantize_keys,
    quantize_values,
)

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "DEFAULT_RESIDUAL_LENGTH",
    "KIVICache",
    "check_kivi_settings",
    "default_group_size",
    "dequantize",
    "fake_quantize",
    "kivi_bytes_per_token",
    "kivi_cache_factory",
    "kivi_cache_nbytes",
    "quantize_keys",
    "quantize_values",
]
