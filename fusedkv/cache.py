"""KV caches for FusedKV models and their measured size.

The default cache is transformers' `DynamicCache`: the model writes only storage layers into it, so
reconstruction layers' slots stay empty and the bytes held are exactly what the plan promises.
`StaticKVCache` is a preallocated, fixed-shape cache (gpt-fast style) for storage layers only, for
decode loops that want no allocation per step (and fixed shapes for torch.compile / CUDA graphs).
"""

from __future__ import annotations

import torch

from .plan import SLIDING


def kv_cache_nbytes(cache) -> int:
    """Bytes of K/V tensors actually held by a cache (empty layers count zero). Caches that know
    their own layout (`StaticKVCache`, `fusedkv.quant.KIVICache`) count themselves."""
    if callable(getattr(cache, "nbytes", None)):
        return cache.nbytes()
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


class StaticKVCache:
    """Preallocated K/V for the storage layers of a plan: `[B, H_kv, max_len, D]` each.

    `update` writes the new tokens in place and returns views of the filled prefix, so the model
    code is the same as with `DynamicCache`. Only storage layers get buffers: the half-size cache
    is allocated once, up front. Sliding-window storage layers hold only the last `sliding_window - 1`
    tokens (`[B, H_kv, W - 1, D]`, like transformers' `DynamicSlidingWindowLayer`): `update` returns
    those plus the new ones, the last keys a window query can see, so their memory stays bounded.
    They are rings: a token is written once, into the slot of the oldest, never shifted. Row b's token
    of column p lives in slot C - 1 - ((p - window_start[b]) mod C) (C = W - 1; `window_start`: each row's
    first real column, from `set_padding`), so the tokens a row holds always fill the slots [C - held, C)
    and the native decode step (`fusedkv.engine.native_step`) reads them as one key range per row; `update`
    gathers them back into column order for the modules.
    `dtype` may be narrower than the model's: a 16-bit cache under f32 activations halves the bytes
    again on top of the plan's half-size cache (attention then runs in the cache's dtype).
    """

    is_compileable = False  # the model builds its own masks; transformers must not pre-build 4-D ones

    def __init__(self, config, batch_size: int, max_len: int, dtype=torch.float32, device=None):
        if max_len > config.max_position_embeddings:
            raise ValueError(
                f"StaticKVCache max_len={max_len} exceeds max_position_embeddings={config.max_position_embeddings}"
            )
        if not dtype.is_floating_point:
            raise ValueError(f"StaticKVCache dtype {dtype}: use a floating dtype (float32, bfloat16, float16)")
        k_shape = v_shape = (batch_size, config.num_key_value_heads, max_len, config.head_dim)
        if getattr(config, "kv_lora_rank", None) is not None:  # MLA: keys = latent, values = RoPE key (one head)
            k_shape, v_shape = (batch_size, 1, max_len, config.kv_lora_rank), (batch_size, 1, max_len, config.head_dim)
        self.max_len = max_len
        window = getattr(config, "sliding_window", None)
        self.windowed = {i: min(window - 1, max_len) for i in config.plan.storage_layers
                         if window and config.plan.layers[i].attention_type == SLIDING}

        def shape(base, i):
            return (*base[:2], self.windowed[i], base[3]) if i in self.windowed else base

        self.keys = {i: torch.zeros(shape(k_shape, i), dtype=dtype, device=device) for i in config.plan.storage_layers}
        self.values = {i: torch.zeros(shape(v_shape, i), dtype=dtype, device=device)
                       for i in config.plan.storage_layers}
        self._length = 0
        self._last = max(self.keys)  # the last storage layer advances the length
        self.window_start = torch.zeros(batch_size, dtype=torch.int64, device=device)

    def set_padding(self, padding_mask: torch.Tensor) -> None:
        """Take each row's first real column from a left-padded [B, T] prompt mask (1 = real) before the
        prompt is written: window rings place a row's tokens from there (see the class docstring)."""
        if self._length:
            raise ValueError("StaticKVCache.set_padding must come before the prompt is written")
        self.window_start = padding_mask.long().argmax(-1).to(self.window_start.device)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._length

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args, **kwargs):
        start, t = self._length, k.shape[2]
        self._check_room(t)
        if layer_idx in self.windowed:
            return self._update_window(k, v, layer_idx, start, t)
        self.keys[layer_idx][:, :, start : start + t] = k
        self.values[layer_idx][:, :, start : start + t] = v
        if layer_idx == self._last:
            self._length += t  # the last storage layer of this forward has written: advance
        return self.keys[layer_idx][:, :, : start + t], self.values[layer_idx][:, :, : start + t]

    def _update_window(self, k, v, layer_idx: int, start: int, t: int):
        """The last `held` tokens (gathered from the ring in column order) plus the new ones are what a window
        query sees; the new ones (the last C of them) go into the ring slots of the oldest."""
        capacity = self.windowed[layer_idx]
        held = min(start, capacity)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        past = self._slots(start - held, start, capacity, keys.shape)
        k, v = k.to(keys.dtype), v.to(values.dtype)  # attended as stored, as full layers' keys are
        full_k = torch.cat([keys.gather(2, past), k], dim=2)
        full_v = torch.cat([values.gather(2, past), v], dim=2)
        keep = min(capacity, t)
        if keep:
            new = self._slots(start + t - keep, start + t, capacity, keys.shape)
            keys.scatter_(2, new, k[:, :, -keep:])
            values.scatter_(2, new, v[:, :, -keep:])
        if layer_idx == self._last:
            self._length += t
        return full_k, full_v

    def _slots(self, first: int, end: int, capacity: int, shape) -> torch.Tensor:
        """The ring slots of columns [first, end) per row, as a gather / scatter index [B, H_kv, end - first, D]."""
        columns = torch.arange(first, end, device=self.window_start.device)
        slots = capacity - 1 - (columns[None, :] - self.window_start[:, None]) % capacity
        return slots[:, None, :, None].expand(shape[0], shape[1], end - first, shape[3])

    def advance(self, t: int) -> None:
        """Count `t` new tokens that a writer filling every storage layer's buffers itself has written (the
        native decode step, `fusedkv.engine.native_step`), as `update` counts them."""
        self._check_room(t)
        self._length += t

    def _check_room(self, t: int) -> None:
        if self._length + t > self.max_len:
            raise ValueError(f"StaticKVCache is full: {self._length} + {t} tokens exceed max_len={self.max_len}")

    def reset(self) -> None:
        self._length = 0
        self.window_start.zero_()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.keys, self.values) for t in d.values())
