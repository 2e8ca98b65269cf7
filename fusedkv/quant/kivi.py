"""KIVI: 2/4-bit asymmetric KV-cache quantisation (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric
2bit Quantization for KV Cache"), as the FusedKV paper stacks it on the half-size cache (App. A.6).

The scheme, exactly as KIVI's Algorithm 1 and reference code:
  * keys are quantised per channel: each group of G consecutive tokens shares one (scale, zero) per
    channel (KIVI Sec. 3: key outliers live in fixed channels);
  * values are quantised per token: each token's channels are split into groups of G channels that
    share one (scale, zero) (value errors must stay local to a token);
  * asymmetric min/max: scale = (max - min) / (2^b - 1), zero = min, x ~ code * scale + zero;
  * a full-precision residual of the most recent tokens: keys stay in full precision until R of them
    have gathered, then those R/G whole groups are quantised together; values keep the last R tokens
    in full precision and quantise each older token as it leaves the window;
  * attention at a step reads dequantised past + full-precision residual, the new tokens included
    (the flush happens after they are returned, as in KIVI's code). A prefill therefore attends over
    its own K/V in full precision and stores them quantised.

The arithmetic (quantise, pack, dequantise, closed-form sizes) is `fusedkv.quant.kivi_codes`; this module is
the cache. Storage is real: codes are bit-packed along the channel axis (4 per byte at 2 bits, 2 per byte at
4 bits) in uint8, scales and zeros are fp16. `KIVICache.nbytes()` walks the tensors actually held
(storage, not views) and equals `kivi_cache_nbytes`, the closed form.

In a FusedKV model only storage layers write a cache (`fusedkv.model.attention`): they call
`cache.update` and attend over what it returns, and reconstruction layers fuse those same returned
(dequantised) tensors, so every plan, `model.generate()` and the lean loop work unchanged.

Decoding on CPU: the native decode step (`fusedkv.engine.native_step`) reads the codes, scales and residual
in place (`fusedkv/kernels/cpu_kivi_attention.c`), so nothing is dequantised per step. It takes a cache that
knows its `max_len` (`kivi_cache_factory` passes generate's) and preallocates it once (`KIVICache.reserve`,
`KIVIStore`), then appends and quantises in those buffers itself, with the same arithmetic as here.

Padding: KIVI's key groups are runs of G tokens and its flushes follow the token count, so a left-padded
row must not count its padding, or its groups would straddle padding and real tokens (pad keys joining
the per-channel min/max) and fall on other columns than the same prompt's alone. `KIVICache.set_padding`
(which `fusedkv.generation.generate` calls with the prompt's mask; call it yourself before
`model.generate(attention_mask=...)`) gives each padded row a cache of its own that stores its real tokens
only, aligned to its first one: the row then decodes exactly as the same prompt alone. Padding positions
are returned as zeros (the attention mask hides them) and are not stored.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import CacheLayerMixin

from .kivi_codes import (
    DEFAULT_RESIDUAL_LENGTH,
    SCALE_DTYPE,
    QuantizedKV,
    check_kivi_settings,
    default_group_size,
    dequantize,
    quantize_keys,
    quantize_values,
    quantized_token_counts,
)
from .storage import StorageLayersCache

# --- preallocated storage (the native decode step) ---------------------------------------------


class KIVIStore:
    """One layer's (or one padded row's) KIVI tensors in buffers preallocated for `capacity` tokens, so that a
    writer outside PyTorch (the native decode step, `fusedkv/kernels/cpu_kivi_attention.c`) appends and
    quantises in place: key codes [B, H, Kc, D*bits/8] with scale / zero [B, H, Kc/G, D], value codes
    [B, H, Vc, D*bits/8] with scale / zero [B, H, Vc, D/G], where Kc and Vc are the quantised counts at
    `capacity` tokens; residuals [B, H, R, D] (keys) and [B, H, R + 1, D] (values: one pending token beyond
    the window until the flush). What a layer holds at n tokens are views of these (`views`)."""

    def __init__(self, batch: int, heads: int, head_dim: int, capacity: int, bits: int, group_size: int,
                 residual_length: int, dtype: torch.dtype, device):
        self.bits, self.group_size, self.residual_length, self.capacity = bits, group_size, residual_length, capacity
        k_cap, v_cap = quantized_token_counts(capacity, residual_length)
        width = head_dim * bits // 8

        def zeros(*shape, dt=torch.uint8):
            return torch.zeros(batch, heads, *shape, dtype=dt, device=device)

        self.k_codes, self.v_codes = zeros(k_cap, width), zeros(v_cap, width)
        self.k_scale, self.k_zero = (zeros(k_cap // group_size, head_dim, dt=SCALE_DTYPE) for _ in range(2))
        self.v_scale, self.v_zero = (zeros(v_cap, head_dim // group_size, dt=SCALE_DTYPE) for _ in range(2))
        self.k_res = zeros(residual_length, head_dim, dt=dtype)
        self.v_res = zeros(residual_length + 1, head_dim, dt=dtype)

    def views(self, n: int):
        """(keys, values, quantized_keys, quantized_values) of a layer holding n tokens, as views."""
        if n > self.capacity:
            raise ValueError(f"the KIVI cache was reserved for {self.capacity} tokens; {n} do not fit")
        qk, qv = quantized_token_counts(n, self.residual_length)
        g = self.group_size
        keys = QuantizedKV(self.k_codes[:, :, :qk], self.k_scale[:, :, :qk // g], self.k_zero[:, :, :qk // g],
                           self.bits, g, "channel") if qk else None
        values = QuantizedKV(self.v_codes[:, :, :qv], self.v_scale[:, :, :qv], self.v_zero[:, :, :qv],
                             self.bits, g, "token") if qv else None
        return self.k_res[:, :, :n - qk], self.v_res[:, :, :n - qv], keys, values

    def load(self, layer: KIVILayer) -> None:
        """Copy what `layer` holds (tensors of its own, after a PyTorch update) into the buffers."""
        pairs = [(self.k_res, layer.keys), (self.v_res, layer.values)]
        for buffers, q in (((self.k_codes, self.k_scale, self.k_zero), layer.quantized_keys),
                           ((self.v_codes, self.v_scale, self.v_zero), layer.quantized_values)):
            if q is not None:
                pairs += zip(buffers, q.tensors())
        for buffer, t in pairs:
            if t.shape[2] > buffer.shape[2]:
                raise ValueError(f"the KIVI cache was reserved for {self.capacity} tokens; {layer.length} do not fit")
            if t.data_ptr() != buffer.data_ptr():  # a view of the buffer already is in place
                buffer[:, :, :t.shape[2]].copy_(t)


# --- the cache ----------------------------------------------------------------------------------


class KIVILayer(CacheLayerMixin):
    """One storage layer's KIVI cache: quantised keys/values plus their full-precision residuals."""

    is_compileable = False
    is_sliding = False

    def __init__(self, bits: int, group_size: int, residual_length: int):
        super().__init__()
        self.bits, self.group_size, self.residual_length = bits, group_size, residual_length
        self.keys = self.values = None  # full-precision residuals [B, H, t, D] (transformers' names)
        self.quantized_keys: QuantizedKV | None = None
        self.quantized_values: QuantizedKV | None = None
        self.length = 0
        # Left padding (`set_padding`): one single-row layer per row, holding its real tokens only, and the
        # column of each row's first real token.
        self.rows: list[KIVILayer] | None = None
        self.starts: list[int] | None = None
        self.store: KIVIStore | None = None  # `reserve`: tensors live in preallocated buffers

    def reserve(self, batch: int, heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device) -> None:
        """Hold everything in buffers preallocated for `capacity` tokens (`KIVIStore`) from now on, so that the
        native decode step writes into them in place; a padded layer reserves each row's own."""
        if self.length:
            raise ValueError("reserve a KIVI cache before the prompt is stored")
        if self.rows is not None:
            for row in self.rows:
                row.reserve(1, heads, head_dim, capacity, dtype, device)
            return
        self.store = KIVIStore(batch, heads, head_dim, capacity, self.bits, self.group_size, self.residual_length,
                               dtype, device)
        self.dtype, self.device, self.is_initialized = dtype, device, True
        self._view()

    def _view(self) -> None:
        self.keys, self.values, self.quantized_keys, self.quantized_values = self.store.views(self.length)

    def advance(self, t: int) -> None:
        """Count `t` tokens that the native decode step appended and flushed in the reserved buffers itself."""
        self.length += t
        for row in self.rows or ():
            row.advance(t)
        if self.store is not None:
            self._view()

    def set_padding(self, starts: list[int]) -> None:
        """Rows begin with `starts[b]` padding columns (before anything is stored): from now on each row is
        quantised on its own, its groups aligned to its first real token, its padding never stored."""
        if self.length:
            raise ValueError("set the padding of a KIVI cache before the prompt is stored")
        self.rows = [KIVILayer(self.bits, self.group_size, self.residual_length) for _ in starts]
        self.starts = list(starts)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys, self.values = key_states[:, :, :0].clone(), value_states[:, :, :0].clone()
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new tokens; return dequantised past + full-precision residual (new tokens
        included); then move what left the residual window into quantised storage."""
        if self.rows is not None:
            return self._update_rows(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=2)
        self.values = torch.cat([self.values, value_states], dim=2)
        self.length += key_states.shape[2]
        keys, values = self.keys, self.values
        if self.quantized_keys is not None:
            keys = torch.cat([dequantize(self.quantized_keys, self.dtype), keys], dim=2)
        if self.quantized_values is not None:
            values = torch.cat([dequantize(self.quantized_values, self.dtype), values], dim=2)
        self._flush()
        if self.store is not None:  # back into the reserved buffers (a prefill; or a step run module by module)
            self.store.load(self)
            self._view()
        return keys, values

    def _update_rows(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """`update` of a left-padded batch: each row's real new columns go to its own layer; the rows'
        returns are put back on the batch's columns, padding as zeros."""
        if not self.is_initialized:
            self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
        past, t = self.length, key_states.shape[2]
        self.length += t
        out_k = key_states.new_zeros(*key_states.shape[:2], self.length, key_states.shape[3])
        out_v = value_states.new_zeros(*value_states.shape[:2], self.length, value_states.shape[3])
        for b, (row, start) in enumerate(zip(self.rows, self.starts)):
            first = min(max(start - past, 0), t)  # the first of the new columns that is a real token
            k, v = row.update(key_states[b:b + 1, :, first:], value_states[b:b + 1, :, first:])
            out_k[b, :, self.length - k.shape[2]:] = k[0]
            out_v[b, :, self.length - v.shape[2]:] = v[0]
        return out_k, out_v

    def _flush(self) -> None:
        r = self.residual_length
        full_windows = (self.keys.shape[2] // r) * r
        if full_windows:
            q = quantize_keys(self.keys[:, :, :full_windows], self.bits, self.group_size)
            self.quantized_keys = q if self.quantized_keys is None else self.quantized_keys.cat(q)
            self.keys = self.keys[:, :, full_windows:].clone()  # clone: let the quantised part's memory go
        leaving = self.values.shape[2] - r
        if leaving > 0:
            q = quantize_values(self.values[:, :, :leaving], self.bits, self.group_size)
            self.quantized_values = q if self.quantized_values is None else self.quantized_values.cat(q)
            self.values = self.values[:, :, leaving:].clone()

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def tensors(self) -> list[torch.Tensor]:
        if self.rows is not None:
            return [t for row in self.rows for t in row.tensors()]
        out = [t for t in (self.keys, self.values) if t is not None]
        for q in (self.quantized_keys, self.quantized_values):
            if q is not None:
                out.extend(q.tensors())
        return out

    def reset(self) -> None:
        self.keys = self.values = None
        self.quantized_keys = self.quantized_values = None
        self.length = 0
        self.is_initialized = False
        self.rows = self.starts = None
        self.store = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if not self.is_initialized:
            return
        if self.rows is not None:
            order = beam_idx.tolist()
            self.rows = [copy.deepcopy(self.rows[i]) for i in order]  # a row may be chosen twice
            self.starts = [self.starts[i] for i in order]
            return
        beam_idx = beam_idx.to(self.device)
        self.keys, self.values = self.keys.index_select(0, beam_idx), self.values.index_select(0, beam_idx)
        if self.quantized_keys is not None:
            self.quantized_keys = self.quantized_keys.index_select(beam_idx)
        if self.quantized_values is not None:
            self.quantized_values = self.quantized_values.index_select(beam_idx)
        if self.store is not None:
            self.store.load(self)
            self._view()


class KIVICache(StorageLayersCache):
    """A transformers `Cache` with a `KIVILayer` for each of the plan's storage layers (reconstruction
    layers hold nothing); `group_size` None: `default_group_size` of the model's head dimension. Pass it
    as `cache=` to the model, to `model.generate(past_key_values=...)`,
    or build it through `kivi_cache_factory` for `fusedkv.generation.generate`."""

    quantization = "kivi"  # how the engine's selection recognises the cache (it cannot import this package)

    def __init__(self, config, bits: int = 4, group_size: int | None = None,
                 residual_length: int = DEFAULT_RESIDUAL_LENGTH, max_len: int | None = None):
        self.max_len = max_len  # tokens a generation will hold, when known: what `reserve` preallocates
        self.num_key_value_heads, self.head_dim = config.num_key_value_heads, config.head_dim
        if group_size is None:
            group_size = default_group_size(config.head_dim, residual_length)
        check_kivi_settings(bits, group_size, residual_length, config.head_dim)
        super().__init__(config, lambda: KIVILayer(bits, group_size, residual_length))
        self.bits, self.group_size, self.residual_length = bits, group_size, residual_length

    def set_padding(self, attention_mask: torch.Tensor) -> None:
        """Declare the prompt's left padding ([B, T] mask, 1 = real token) before the prompt is stored, so
        that each row is quantised as it would be alone (module docstring). No padding: nothing changes."""
        mask = attention_mask.bool()
        starts = (~mask).long().sum(-1)
        if bool((mask.long().argmax(-1) != starts).any() | ~mask[:, -1].all()):
            raise ValueError("KIVICache.set_padding takes left padding only (each row: padding, then its tokens)")
        if not bool(starts.any()):
            return
        for layer in self.layers:
            if isinstance(layer, KIVILayer):
                layer.set_padding(starts.tolist())

    def reserve(self, batch: int, dtype: torch.dtype, device="cpu") -> None:
        """Preallocate every storage layer's buffers for `max_len` tokens (`KIVIStore`), before the prompt is
        stored and after `set_padding`: the native decode step then appends and quantises in place."""
        if self.max_len is None:
            raise ValueError("reserving a KIVI cache needs its max_len (kivi_cache_factory passes generate's)")
        for layer in self.layers:
            if isinstance(layer, KIVILayer):
                layer.reserve(batch, self.num_key_value_heads, self.head_dim, self.max_len, dtype, device)

    def advance(self, t: int) -> None:
        """Count `t` tokens the native decode step appended to every storage layer itself (as `StaticKVCache`)."""
        for layer in self.layers:
            if isinstance(layer, KIVILayer):
                layer.advance(t)

    def reset(self) -> None:
        for layer in self.layers:
            if isinstance(layer, KIVILayer):
                layer.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for layer in self.layers:
            if isinstance(layer, KIVILayer):
                layer.reorder_cache(beam_idx)

    def nbytes(self) -> int:
        """Bytes of memory actually held: every tensor's underlying storage, counted once. A reserved cache
        (`reserve`) counts the bytes of the tokens it holds, as the closed form does, not its preallocation."""
        storages, reserved = {}, 0
        for layer in self.layers:
            if isinstance(layer, KIVILayer):
                for row in layer.rows or [layer]:
                    for t in row.tensors():
                        if row.store is not None:
                            reserved += t.numel() * t.element_size()
                            continue
                        s = t.untyped_storage()
                        storages[s.data_ptr()] = s.nbytes()
        return sum(storages.values()) + reserved


def kivi_cache_factory(bits: int, group_size: int | None = None,
                       residual_length: int = DEFAULT_RESIDUAL_LENGTH):
    """A `cache_factory(config, batch, max_len, dtype, device)` for `fusedkv.generation.generate`
    (`group_size` None: `default_group_size` of the model)."""

    def factory(config, batch_size=None, max_len=None, dtype=None, device=None):
        return KIVICache(config, bits, group_size, residual_length, max_len)

    return factory
