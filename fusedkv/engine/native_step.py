"""The decoder layers of a one-token CPU decode step as one native call (`fusedkv/kernels/cpu_decode_step.c`).

Run module by module, a decode step of a small model spends milliseconds on dispatch alone: about forty
PyTorch ops per layer around the weight products (`benchmarks/cpu_decode.py --overhead`; figures in
`docs/cpu-decode.md`). `NativeDecodeStep` takes that floor away the way gpt-fast and llama.cpp do, by
deciding everything once: it reads the model's weights (in the decode layout of
`fusedkv.engine.packing`), the plan's sources and fusion weights, and the static cache's buffers into a
table of pointers when it is built, and each step is then the embedding, one C call through every
layer, the final norm and the LM head. The arithmetic is the modules' own (storage layers write their
post-RoPE K/V into the cache; reconstruction layers attend over their sources with the fusion weights
moved onto the query and output, paper Sec. 2.5), checked against the model's forward by the tests.

It covers what the fast CPU path is for: weights f32 in the packed decode layout, bf16 / int8 in the
block layout of `fusedkv.engine.precision` (processors with AVX-512 BF16), or int4 blocks (any); batch
<= 4; full attention over 1-2 K / V sources with per-channel weights or plain reuse (every plan of
`fusedkv.plan`); dense SwiGLU MLPs; a static cache or a KIVI cache (`fusedkv.quant.KIVICache`, read in place by
`fusedkv.kernels.cpu_kivi`: the step appends each token to its residual and quantises what leaves the window after
every layer has read it). `unsupported` names the first thing it does not cover, and the caller then keeps the
module-by-module step, which runs everything (MoE, MLA, sliding windows, f16 weights).
"""

from __future__ import annotations

import ctypes

import torch

from ..kernels import cpu_attention, cpu_gemv, cpu_kivi, native
from ..model.attention import Attention
from ..model.layers import SwiGLU, rope_inv_freq, rope_tables
from .packing import decode_products
from .precision import ReducedLinear

P, I, L, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
MAX_HEAD_DIM = 512  # the C step's per-head buffers
W_F32, W_BF16_BLOCKS, W_INT8_BLOCKS, W_INT4_BLOCKS = 0, 1, 2, 3  # the weight layouts of `Product` in cpu_decode_step.c


class _Product(ctypes.Structure):  # `Product` in cpu_decode_step.c, field for field
    _fields_ = [("fmt", I), ("in_", I), ("in_padded", I), ("out", I), ("w", P), ("ld", L), ("scale", P), ("bias", P)]


class _Layer(ctypes.Structure):  # `StepLayer`
    _fields_ = [("stores", I), ("attn_norm", P), ("mlp_norm", P), ("proj", _Product), ("q_norm", P), ("k_norm", P),
                ("k_cache", P), ("v_cache", P), ("n_k", I), ("n_v", I), ("k_src", P * 2), ("v_src", P * 2),
                ("k_w", P * 2), ("v_w", P * 2), ("k_w_hs", L), ("v_w_hs", L),
                ("o", _Product), ("gate_up", _Product), ("down", _Product)]


class _Step(ctypes.Structure):  # `Step` in cpu_decode_step.c
    _fields_ = [("n_layers", I), ("hidden", I), ("n_heads", I), ("n_kv_heads", I), ("head_dim", I), ("inter", I),
                ("batch", I), ("kind", I), ("cache_len", L), ("eps", F), ("scale", F), ("cos", P), ("sin", P),
                ("layers", ctypes.POINTER(_Layer)),
                ("h", P), ("proj", P), ("q", P), ("attn", P), ("gu", P), ("act", P), ("xb", P), ("kivi", P)]


def _product(module) -> _Product | None:
    """The native description of one product (a projection, or a packed group of them), or None when its
    weight is in no layout the native products read: f32 in the decode layout, bf16 / int8 blocks, or int4
    blocks whose outputs are whole blocks (the step lays the outputs of one product side by side)."""
    weight, bias = module.weight, module.bias
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    if isinstance(module, ReducedLinear):
        if not module.blocked:
            return None
        if module.fmt == "int4":
            if module.out_features != weight.shape[0] * cpu_gemv.BLOCK:
                return None
            return _Product(W_INT4_BLOCKS, module.in_features, weight.shape[1] * cpu_gemv.GROUP, module.out_features,
                            weight.data_ptr(), weight.stride(0), module.scale.data_ptr(),
                            None if bias is None else bias.data_ptr())
        fmt = W_INT8_BLOCKS if module.fmt == "int8" else W_BF16_BLOCKS
        scale = module.scale.data_ptr() if fmt == W_INT8_BLOCKS else None
        return _Product(fmt, module.in_features, 2 * weight.shape[1], module.out_features, weight.data_ptr(),
                        weight.stride(0), scale, None if bias is None else bias.data_ptr())
    if weight.dtype != torch.float32 or weight.stride(0) != 1:
        return None
    return _Product(W_F32, weight.shape[1], weight.shape[1], weight.shape[0], weight.data_ptr(), weight.stride(1),
                    None, None if bias is None else bias.data_ptr())


def _products(layer) -> dict[str, _Product] | None:
    """The native descriptions of a decoder layer's four products as the engine laid them out
    (`fusedkv.engine.packing.decode_products`: the packed group, or a reduced group's one module), or None
    when one is in no layout the step reads."""
    attn, mlp = decode_products(layer.self_attn), decode_products(layer.mlp)
    if attn is None or mlp is None:
        return None
    modules = {"proj": attn["q_proj"], "o": attn["o_proj"], "gate_up": mlp["gate_proj"], "down": mlp["down_proj"]}
    products = {name: _product(m) for name, m in modules.items()}
    return None if None in products.values() else products


def _kivi_unsupported(config, cache) -> str | None:
    """Why the step cannot read this `fusedkv.quant.KIVICache` (`fusedkv.kernels.cpu_kivi`), or None."""
    if cache.max_len is None:
        return "the KIVI cache does not know its max_len (build it with kivi_cache_factory)"
    return cpu_kivi.supports(cache.bits, cache.group_size, cache.residual_length, config.head_dim,
                             config.num_attention_heads, config.num_key_value_heads)


def unsupported(model, keys: dict[int, torch.Tensor], values: dict[int, torch.Tensor], batch: int,
                kivi=None) -> str | None:
    """Why the native step cannot run `model` over these cache buffers (or this KIVI cache) at this batch, or
    None when it can."""
    config = model.config
    if not native.available():
        return "the native CPU kernels are not built here"
    if batch > cpu_gemv.MAX_ROWS:
        return f"batch {batch} > {cpu_gemv.MAX_ROWS}"
    if model.device.type != "cpu" or model.dtype != torch.float32 or model.training:
        return "the model is not an f32 CPU model in eval mode"
    if config.kv_lora_rank is not None or config.num_experts > 0 or config.hidden_act != "silu":
        return "MLA, MoE and activations other than SiLU run module by module"
    features = [f for f in config.extra_block_features() if f != "attention_output_bias"]  # O bias: read as set
    if features:  # the C step computes the Qwen3 block only
        return f"{', '.join(features)} run module by module"
    if config.head_dim > MAX_HEAD_DIM or config.head_dim % 2:
        return f"head_dim {config.head_dim} is odd or above {MAX_HEAD_DIM}"
    if kivi is not None:
        reason = _kivi_unsupported(config, kivi)
        if reason is not None:
            return reason
    elif sorted(config.plan.storage_layers) != sorted(keys):
        return "the cache does not hold exactly the plan's storage layers"
    buffers = [*keys.values(), *values.values()] if kivi is None else []
    first = buffers[0] if buffers else None
    if buffers and first.dtype not in cpu_attention.KINDS or any(
            b.dtype != first.dtype or b.shape != first.shape or not b.is_contiguous() or b.shape[0] != batch
            for b in buffers):
        return "the cache buffers are not one contiguous [B, H_kv, S, D] shape and dtype (a window cache?)"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn, Attention) or not isinstance(mlp, SwiGLU):
            return "a layer is not Qwen3 attention with a dense MLP"
        kv = attn.layer
        counts = (1, 1) if kv.stores else (len(kv.k_sources), len(kv.v_sources))
        if attn.window or "scalar" in (kv.k_fusion, kv.v_fusion) or not cpu_attention.supports(
                attn.head_dim, attn.num_heads, attn.num_kv_heads, *counts):
            return f"layer {kv.index + 1}: a window, scalar weights or more than two sources"
        if _products(layer) is None:
            return ("the weights are not f32 in the packed decode layout (fusedkv.engine.packing.set_decode_layout) "
                    "or bf16 / int8 blocks or int4 blocks of fusedkv.engine.precision")
    return None


class _Source:
    """A KIVI storage layer's row table where the step takes a static buffer: only its address is read."""

    dtype = torch.float32  # the residual's (the model's) dtype

    def __init__(self, address: int):
        self.address = address

    def data_ptr(self) -> int:
        return self.address


class Unsupported(ValueError):
    """The native step does not cover this model, cache or batch (the message says why)."""


class NativeDecodeStep:
    """`step(token, kv_start, length)` -> logits [B, 1, V] of one new token per row, with its K/V written into
    `keys` / `values` (the static cache's storage-layer buffers, [B, H_kv, S, D]) at column `length`; the
    caller counts the token in its cache. `kv_start` [B]: each row's first real key (left padding), or None.
    Built once per generation; raises `Unsupported` (a ValueError) with what `unsupported` names.
    `kivi`: a `fusedkv.quant.KIVICache` instead of static buffers (keys / values ignored): reserved here for
    its max_len tokens before the prompt is stored, read and written in place (`fusedkv.kernels.cpu_kivi`)."""

    def __init__(self, model, keys: dict[int, torch.Tensor], values: dict[int, torch.Tensor], batch: int,
                 kivi=None):
        reason = unsupported(model, keys, values, batch, kivi)
        if reason is not None:
            raise Unsupported(f"the native decode step does not cover this model: {reason}")
        self.model = model
        config = model.config
        d, h_q, h_kv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        hidden, inter = config.hidden_size, config.intermediate_size
        self._keep: list[torch.Tensor] = []  # every tensor a pointer in the table refers to stays alive here
        self._kivi = None
        if kivi is not None:
            keys, values, cache_len = self._kivi_tables(kivi, batch)
        else:
            cache_len = next(iter(keys.values())).shape[2]
        positions = torch.arange(cache_len).unsqueeze(0)
        cos, sin = rope_tables(positions, rope_inv_freq(config)[0], torch.float32)
        cos, sin = self._hold(cos.reshape(cache_len, d)), self._hold(sin.reshape(cache_len, d))
        layers = (_Layer * len(model.model.layers))()
        for table, layer in zip(layers, model.model.layers):
            self._fill(table, layer, keys, values, h_kv, d)
        self._layers = layers
        proj_max = max(table.proj.out for table in layers)
        widest = max(p.in_padded for t in layers for p in (t.proj, t.o, t.gate_up, t.down))
        scratch = [torch.empty(batch, n) for n in (hidden, proj_max, h_q * d, h_q * d, 2 * inter, inter)]
        scratch.append(torch.empty(batch, widest, dtype=torch.bfloat16))
        self._keep += scratch
        self._step = _Step(len(layers), hidden, h_q, h_kv, d, inter, batch,
                           cpu_attention.KINDS[next(iter(keys.values())).dtype], cache_len, config.rms_norm_eps,
                           d**-0.5, cos.data_ptr(), sin.data_ptr(), layers,
                           *(t.data_ptr() for t in scratch), self._kivi)
        self._address = ctypes.addressof(self._step)
        self._lib = native.library()

    def _kivi_tables(self, cache, batch: int):
        """Reserve the KIVI cache and describe each storage layer's rows to C (`cpu_kivi.row_table`): the step
        reads those tables where it reads static buffers otherwise (`_Source` stands in for a buffer)."""
        cache.reserve(batch, torch.float32)
        self._kivi_shape = cpu_kivi.shape_of(cache)
        self._kivi = ctypes.addressof(self._kivi_shape)
        self._tables = {i: cpu_kivi.row_table(cache.layers[i], batch) for i in self.model.config.plan.storage_layers}
        sources = {i: _Source(ctypes.addressof(t)) for i, t in self._tables.items()}
        return sources, sources, cache.max_len

    def _hold(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().to(torch.float32).contiguous()
        self._keep.append(t)
        return t

    def _fill(self, table: _Layer, layer, keys, values, h_kv: int, d: int) -> None:
        attn, kv = layer.self_attn, layer.self_attn.layer
        table.stores = kv.stores
        table.attn_norm = self._hold(layer.input_layernorm.weight).data_ptr()
        table.mlp_norm = self._hold(layer.post_attention_layernorm.weight).data_ptr()
        for name, product in _products(layer).items():
            setattr(table, name, product)
        table.q_norm = self._hold(attn.q_norm.weight).data_ptr()
        if kv.stores:
            table.k_norm = self._hold(attn.k_norm.weight).data_ptr()
            table.k_cache, table.v_cache = keys[kv.index].data_ptr(), values[kv.index].data_ptr()
            k_src, v_src, k_w, v_w = [keys[kv.index]], [values[kv.index]], [None], [None]
        else:
            k_src, v_src = [keys[s] for s in kv.k_sources], [values[s] for s in kv.v_sources]
            key_weights, value_weights = attn.fusion.weights()
            k_w = [None if w is None else self._hold(w) for w in key_weights]
            v_w = [None if w is None else self._hold(w) for w in value_weights]
        table.n_k, table.n_v = len(k_src), len(v_src)
        table.k_src[:] = [k_src[0].data_ptr(), k_src[-1].data_ptr()]
        table.v_src[:] = [v_src[0].data_ptr(), v_src[-1].data_ptr()]
        (k0, k1, table.k_w_hs), (v0, v1, table.v_w_hs) = (cpu_attention.weight_pointers(k_w, h_kv, d),
                                                          cpu_attention.weight_pointers(v_w, h_kv, d))
        table.k_w[:], table.v_w[:] = [k0, k1], [v0, v1]

    def __call__(self, token: torch.Tensor, kv_start: torch.Tensor | None, length: int) -> torch.Tensor:
        batch = self._step.batch
        if token.shape != (batch, 1) or kv_start is not None and kv_start.shape != (batch,):
            raise ValueError(f"the native decode step was built for {batch} rows of one token: token "
                             f"{tuple(token.shape)}, kv_start {None if kv_start is None else tuple(kv_start.shape)}")
        model = self.model
        x = model.model.embed_tokens(token).contiguous()  # [B, 1, H]: the residual stream, updated in place
        starts = None if kv_start is None else kv_start.to(torch.int64).contiguous()  # as the C side reads it
        status = self._lib.decode_step(self._address, x.data_ptr(), None if starts is None else starts.data_ptr(),
                                       length, torch.get_num_threads())
        if status:
            raise RuntimeError(f"the native decode step refused its arguments (status {status}) at length {length}")
        return model.lm_head(model.model.norm(x))
