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
block layout of `fusedkv.engine.precision` (AVX-512 BF16 or AVX2), or int4 blocks (any); batch
<= 16; attention over 1-2 K / V sources with per-channel weights or plain reuse (every plan of
`fusedkv.plan` but the scalar-weighted fusedkv-dense); sliding-window layers over the static cache's
window rings (`fusedkv.cache.StaticKVCache`); dense gated MLPs (SiLU, GELU, tanh-GELU) and sparse MoE
MLPs (Qwen3-MoE and DeepSeekMoE routing, shared experts; f32 experts in the decode layout); MLA layers
absorbed over the cached latents and RoPE keys (f32 cache; FusedKV on MLA included); and the
imported families' block features: Q/K/V, O and MLP biases, QK-norm or none, Gemma's RMSNorm (1 + w) and
post-norms, embedding scaling, `query_pre_attn_scalar`, attention and final logit soft-capping, every
RoPE scaling but dynamic NTK, a separate RoPE per attention type. `unsupported` names the first thing
it does not cover, and the caller then keeps the module-by-module step, which runs everything. The cache is
a `fusedkv.cache.StaticKVCache` or a KIVI cache (`fusedkv.quant.KIVICache`, read in place by
`fusedkv.kernels.cpu_kivi`: the step appends each token to its residual and quantises what leaves the
residual window after every layer has read it). What it declines, by name: MLA over a 16-bit cache, dynamic
NTK RoPE, fusedkv-dense's scalar fusion and more than two sources, batch above 16, f16 weights (and f32 ones
not in the packed layout), MoE experts not in f32 decode layout, head_dim odd or above 512; over a KIVI cache,
sliding-window layers, MLA and attention soft-capping (the KIVI kernel has none of them), a KIVI cache without
its max_len, and group sizes the kernel does not pack.
"""

from __future__ import annotations

import ctypes

import torch

from ..kernels import cpu_attention, cpu_kivi, native
from ..model.attention import Attention
from ..model.layers import RMSNorm, SwiGLU, rope_inv_freq, rope_tables
from ..model.mla import MLA
from ..model.moe import SparseMoE
from .backends import LayerFacts
from .step_tables import _Layer, _Mla, _MoE, _Product, _products, _Step

MAX_HEAD_DIM = 512  # the C step's per-head buffers
MAX_ROWS = 16  # batch rows (`MAX_ROWS` in cpu_decode_step.c)
# The MLP activations the C step computes (`ACT_*` in cpu_decode_step.c), as transformers' ACT2FN does them.
ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu_new": 1, "gelu": 2}


def _experts_unsupported(moe: SparseMoE) -> str | None:
    """Why the step cannot run this sparse MLP's experts, or None: f32 experts in the decode layout
    (`fusedkv.engine.packing.experts_column_major`)."""
    experts = moe.experts
    for w in (experts.gate_up_proj, experts.down_proj):
        if w.dtype != torch.float32 or w.stride()[1:] != (1, w.shape[1]) or w.stride(0) != w.shape[1] * w.shape[2]:
            return "the MoE experts are not f32 in the decode layout (fusedkv.engine.selection.set_decode_layout)"
    if moe.n_group > 256 or moe.topk_method == "noaux_tc" and moe.experts.num_experts // moe.n_group < 2:
        return "MoE routing over more than 256 groups or groups of one expert"
    return None


def _window_capacity(model, index: int) -> int:
    """Ring slots of storage layer `index`'s cache: W - 1 for a window layer, 0 for full attention (MLA too)."""
    return _window_capacity_of(model.model.layers[index].self_attn)


def _window_capacity_of(attn) -> int:
    window = getattr(attn, "window", None)
    return window - 1 if window else 0


def _kivi_unsupported(model, cache) -> str | None:
    """Why the step cannot read this `fusedkv.quant.KIVICache` (`fusedkv.kernels.cpu_kivi`), or None. The KIVI
    kernel attends over a whole full-attention history with plain scores: window layers, MLA's latents and
    soft-capped scores stay module by module."""
    config = model.config
    if cache.max_len is None:
        return "the KIVI cache does not know its max_len (build it with kivi_cache_factory)"
    if config.kv_lora_rank is not None:
        return "MLA over a KIVI cache runs module by module"
    attns = [layer.self_attn for layer in model.model.layers]
    if any(_window_capacity_of(attn) for attn in attns):
        return "sliding-window layers over a KIVI cache run module by module"
    if any(getattr(attn, "softcap", None) for attn in attns):
        return "attention soft-capping over a KIVI cache runs module by module"
    return cpu_kivi.fits(cache.bits, cache.group_size, cache.residual_length, config.head_dim,
                             config.num_attention_heads, config.num_key_value_heads)


def unsupported(model, keys: dict[int, torch.Tensor], values: dict[int, torch.Tensor], batch: int,
                kivi=None) -> str | None:
    """Why the native step cannot run `model` over these cache buffers (or this KIVI cache) at this batch, or
    None when it can."""
    config = model.config
    if not native.available():
        return "the native CPU kernels are not built here"
    if batch > MAX_ROWS:
        return f"batch {batch} > {MAX_ROWS}"
    if model.device.type != "cpu" or model.dtype != torch.float32 or model.training:
        return "the model is not an f32 CPU model in eval mode"
    if config.hidden_act not in ACTIVATIONS:
        return f"hidden_act {config.hidden_act!r} runs module by module"
    if model.model.dynamic_rope:
        return "dynamic NTK RoPE (frequencies that change with the length) runs module by module"
    if config.head_dim > MAX_HEAD_DIM or config.head_dim % 2:
        return f"head_dim {config.head_dim} is odd or above {MAX_HEAD_DIM}"
    if kivi is None and sorted(config.plan.storage_layers) != sorted(keys):
        return "the cache does not hold exactly the plan's storage layers"
    if kivi is not None:
        reason = _kivi_unsupported(model, kivi)
        if reason is not None:
            return reason
        cache_dtype = torch.float32  # the residual's, as the step writes it
    else:
        buffers = [*keys.values(), *values.values()]
        first = buffers[0]
        if first.dtype not in cpu_attention.KINDS or any(
                b.dtype != first.dtype or not b.is_contiguous() or b.shape[0] != batch for b in buffers):
            return "the cache buffers are not contiguous [B, H_kv, S, D] buffers of one dtype"
        full = [keys[i].shape for i in keys if not _window_capacity(model, i)]
        for i in keys:
            slots = _window_capacity(model, i) or (full[0][2] if full else keys[i].shape[2])
            k_shape = v_shape = (batch, config.num_key_value_heads, slots, config.head_dim)
            if config.kv_lora_rank is not None:  # MLA: latents and RoPE keys, one "head"
                k_shape, v_shape = (batch, 1, slots, config.kv_lora_rank), (batch, 1, slots, config.head_dim)
            if keys[i].shape != k_shape or values[i].shape != v_shape:
                return f"layer {i + 1}'s cache is not [B, H_kv, S, D] (a window layer: S = W - 1)"
        cache_dtype = first.dtype
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn, (Attention, MLA)) or not isinstance(mlp, (SwiGLU, SparseMoE)):
            return "a layer is not attention or MLA with a dense or sparse MLP"
        if isinstance(mlp, SparseMoE) and _experts_unsupported(mlp):
            return _experts_unsupported(mlp)
        kv = attn.layer
        if isinstance(attn, MLA):
            if (cache_dtype != torch.float32 or attn.kv_b_proj.weight.dtype != torch.float32
                    or not attn.kv_b_proj.weight.is_contiguous() or kv.scalar_weighted
                    or max(len(kv.k_sources), len(kv.v_sources)) > 2):
                return (f"layer {kv.index + 1}: MLA runs natively over an f32 cache, kv_b_proj f32 row-major, "
                        "1-2 sources with per-channel weights")
            if _products(layer) is None:
                return "MLA's projections are not f32 in the packed decode layout (fusedkv.engine.packing)"
            continue
        sources = [kv.index] if kv.stores else [*kv.k_sources, *kv.v_sources]
        windows = {_window_capacity(model, i) for i in sources}
        if not LayerFacts.of(attn, config.plan).native_fits:  # what the selection reads too
            return (f"layer {kv.index + 1}: scalar weights, more than two sources, or sources from two kinds of "
                    "cache")
        if len(windows) > 1 or windows != {attn.window - 1 if attn.window else 0} or attn.window == 1:
            return f"layer {kv.index + 1}: its window differs from its sources' caches"
        if _products(layer) is None:
            return ("the weights are not f32 in the packed decode layout (fusedkv.engine.selection.set_decode_layout) "
                    "or bf16 / f16 / int8 / int4 blocks of fusedkv.engine.precision")
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
    `keys` / `values` (the static cache's storage-layer buffers, [B, H_kv, S, D]; window layers' rings
    [B, H_kv, W - 1, D]) at column `length`; the caller counts the token in its cache. `kv_start` [B]: each
    row's first real key (left padding), or None; where the model has window layers it must be the
    `window_start` their rings were filled with (`fusedkv.cache.StaticKVCache.window_start`), and `max_len`
    bounds the columns of a model whose every layer is a window layer (the cache's `max_len`).
    Built once per generation; raises `Unsupported` (a ValueError) with what `unsupported` names.
    `kivi`: a `fusedkv.quant.KIVICache` instead of static buffers (keys / values ignored): reserved here for
    its max_len tokens before the prompt is stored, read and written in place (`fusedkv.kernels.cpu_kivi`)."""

    def __init__(self, model, keys: dict[int, torch.Tensor], values: dict[int, torch.Tensor], batch: int,
                 window_start: torch.Tensor | None = None, max_len: int | None = None, kivi=None):
        reason = unsupported(model, keys, values, batch, kivi)
        if reason is not None:
            raise Unsupported(f"the native decode step does not cover this model: {reason}")
        self.model = model
        config = model.config
        d, h_q, h_kv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        hidden, inter = config.hidden_size, config.intermediate_size
        self._keep: list[torch.Tensor] = []  # every tensor a pointer in the table refers to stays alive here
        self._kivi = None
        if kivi is not None:  # row tables in place of buffers (`_Source`); no window layers (`unsupported`)
            keys, values, cache_len = self._kivi_tables(kivi, batch)
        else:
            full = [keys[i].shape[2] for i in keys if not _window_capacity(model, i)]
            cache_len = full[0] if full else (max_len or config.max_position_embeddings)  # columns the step may write
        self.windowed = any(_window_capacity(model, i) for i in keys)
        self.window_start = None if window_start is None else window_start.to(torch.int64)
        self.cache_len = cache_len
        positions = torch.arange(cache_len).unsqueeze(0)
        decoder = model.model
        tables = {}
        for key in decoder.rope_types:
            inv_freq, scaling = rope_inv_freq(config, key)
            cos, sin = rope_tables(positions, inv_freq, torch.float32, scaling)
            tables[key] = (self._hold(cos.reshape(cache_len, d)), self._hold(sin.reshape(cache_len, d)))
        # Window storage layers' K / V of the step, in the cache's dtype, until they enter the rings.
        pending = {i: (torch.zeros(batch, h_kv, 1, d, dtype=keys[i].dtype),
                       torch.zeros(batch, h_kv, 1, d, dtype=keys[i].dtype)) for i in keys if _window_capacity(model, i)}
        self._keep += [t for pair in pending.values() for t in pair]
        layers = (_Layer * len(decoder.layers))()
        self._moes: list[_MoE] = []
        self._mlas: list[_Mla] = []
        if config.kv_lora_rank is not None:  # MLA's scratch, shared by its layers (see `Mla` in the C step)
            qk = config.qk_nope_head_dim + config.qk_rope_head_dim
            self._mla_scratch = [torch.empty(batch, max(config.q_lora_rank or 0, config.kv_lora_rank + d)),
                                 torch.empty(batch, h_q * qk)]
            self._keep += self._mla_scratch
        for table, layer, rope_key in zip(layers, decoder.layers, decoder.rope_keys):
            self._fill(table, layer, keys, values, pending, tables[rope_key], h_kv, d)
        self._layers = layers
        proj_max = max(table.proj.out for table in layers)
        products = [p for t in layers for p in (t.proj, t.o, t.gate_up, t.down)]
        products += [p for m in self._moes for p in (m.shared_gate_up, m.shared_down) if m.shared_inter]
        products += [p for m in self._mlas for p in (m.q_a, m.q, m.kv_a)]
        widest = max(p.in_padded for p in products)
        attn_width = h_q * (config.v_head_dim if config.kv_lora_rank is not None else d)  # MLA: v_head_dim wide
        scratch = [torch.empty(batch, n) for n in (hidden, proj_max, h_q * d, attn_width, h_q * d, h_q, h_q,
                                                   2 * inter, inter)]
        scratch += [torch.empty(batch, dtype=torch.int64), torch.empty(batch, widest, dtype=torch.bfloat16)]
        if self._moes:  # scores, choice, rows, gate|up, activation, expert output, sum; experts, weights
            m_inter = max(max(m.inter, m.shared_inter) for m in self._moes)
            experts, top_k = config.num_experts, config.num_experts_per_tok
            scratch += [torch.empty(batch, n) for n in (experts, experts, hidden, 2 * m_inter, m_inter, hidden,
                                                        hidden)]
            scratch += [torch.empty(batch, top_k, dtype=torch.int32), torch.empty(batch, top_k)]
        self._keep += scratch
        attn = decoder.layers[0].self_attn
        self._step = _Step(len(layers), hidden, h_q, h_kv, d, inter, batch,
                           cpu_attention.KINDS[next(iter(keys.values())).dtype], ACTIVATIONS[config.hidden_act],
                           cache_len, config.rms_norm_eps, attn.scale, getattr(attn, "softcap", None) or 0.0, layers,
                           *(t.data_ptr() for t in scratch), kivi=self._kivi)
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

    def _gain(self, norm) -> int | None:
        """The pointer to a norm's f32 gain (Gemma's 1 + w computed once, as `RMSNorm.gain`), None for no norm."""
        return None if not isinstance(norm, RMSNorm) else self._hold(norm.gain().float()).data_ptr()

    def _fill(self, table: _Layer, layer, keys, values, pending, rope, h_kv: int, d: int) -> None:
        attn, kv = layer.self_attn, layer.self_attn.layer
        table.stores = kv.stores
        table.window = _window_capacity_of(attn)
        table.attn_norm, table.mlp_norm = self._gain(layer.input_layernorm), self._gain(layer.post_attention_layernorm)
        if layer.post_norms:
            table.post_attn_norm = self._gain(layer.post_attention_output_layernorm)
            table.post_mlp_norm = self._gain(layer.post_feedforward_layernorm)
        table.cos, table.sin = rope[0].data_ptr(), rope[1].data_ptr()
        products = _products(layer)
        for name in ("proj", "o", "gate_up", "down"):
            if name in products and not (isinstance(layer.mlp, SparseMoE) and name in ("gate_up", "down")):
                setattr(table, name, products[name])  # (a sparse MLP's are its shared experts': the MoE's)
        if isinstance(layer.mlp, SparseMoE):
            table.moe = ctypes.pointer(self._moe(layer.mlp, products))
        if isinstance(attn, MLA):
            self._fill_mla(table, attn, keys, values, products)
            return
        table.q_norm = self._gain(attn.q_norm)
        if kv.stores:
            table.k_norm = self._gain(attn.k_norm)
            table.k_cache, table.v_cache = keys[kv.index].data_ptr(), values[kv.index].data_ptr()
            if kv.index in pending:
                table.k_pend, table.v_pend = (t.data_ptr() for t in pending[kv.index])
        k_srcs, v_srcs, k_w, v_w = self._sources(attn)
        table.n_k, table.n_v = len(k_srcs), len(v_srcs)
        table.k_src[:] = [keys[k_srcs[0]].data_ptr(), keys[k_srcs[-1]].data_ptr()]
        table.v_src[:] = [values[v_srcs[0]].data_ptr(), values[v_srcs[-1]].data_ptr()]
        if table.window:
            table.k_pend_src[:] = [pending[k_srcs[0]][0].data_ptr(), pending[k_srcs[-1]][0].data_ptr()]
            table.v_pend_src[:] = [pending[v_srcs[0]][1].data_ptr(), pending[v_srcs[-1]][1].data_ptr()]
        (k0, k1, table.k_w_hs), (v0, v1, table.v_w_hs) = (cpu_attention.weight_pointers(k_w, h_kv, d),
                                                          cpu_attention.weight_pointers(v_w, h_kv, d))
        table.k_w[:], table.v_w[:] = [k0, k1], [v0, v1]

    def _sources(self, attn) -> tuple[list[int], list[int], list, list]:
        """(key source layers, value source layers, their f32 fusion weights or None): the layer's own K/V
        for a storage layer, else its plan's sources with the weights its fusion gives them."""
        kv = attn.layer
        if kv.stores:
            return [kv.index], [kv.index], [None], [None]
        key_weights, value_weights = attn.fusion.weights()
        return (list(kv.k_sources), list(kv.v_sources), [None if w is None else self._hold(w) for w in key_weights],
                [None if w is None else self._hold(w) for w in value_weights])

    def _fill_mla(self, table: _Layer, attn: MLA, keys, values, products: dict[str, _Product]) -> None:
        """An MLA layer's entry: its `Mla` (projections, norms, kv_b_proj read in place, the shared scratch) and
        its sources: RoPE keys as the key side, latents as the value side (`LatentFusion`'s slots); in the
        cache, latents are the keys and RoPE keys the values."""
        kv = attn.layer
        mla = _Mla(attn.num_heads, attn.nope_dim, attn.rope_dim, attn.v_dim, attn.kv_lora_rank, attn.q_lora_rank or 0,
                   int(attn.rope_interleave))
        mla.q = products["proj"]
        if attn.q_lora_rank is not None:
            mla.q_a, mla.q_a_norm = products["q_a"], self._gain(attn.q_a_layernorm)
        if kv.stores:
            mla.kv_a, mla.kv_a_norm = products["kv_a"], self._gain(attn.kv_a_layernorm)
            table.k_cache, table.v_cache = keys[kv.index].data_ptr(), values[kv.index].data_ptr()
        k_srcs, v_srcs, k_w, v_w = self._sources(attn)
        mla.kv_b = attn.kv_b_proj.weight.data_ptr()
        mla.a, mla.q_out = (t.data_ptr() for t in self._mla_scratch)
        table.n_k, table.n_v = len(k_srcs), len(v_srcs)
        table.k_src[:] = [values[k_srcs[0]].data_ptr(), values[k_srcs[-1]].data_ptr()]
        table.v_src[:] = [keys[v_srcs[0]].data_ptr(), keys[v_srcs[-1]].data_ptr()]
        table.k_w[:] = [None if w is None else w.data_ptr() for w in (k_w[0], k_w[-1])]
        table.v_w[:] = [None if w is None else w.data_ptr() for w in (v_w[0], v_w[-1])]
        self._mlas.append(mla)
        table.mla = ctypes.pointer(mla)

    def _moe(self, moe: SparseMoE, products: dict[str, _Product]) -> _MoE:
        """The native description of a sparse MLP (`MoE` in cpu_decode_step.c)."""
        experts, gate = moe.experts, moe.gate
        gate_up, down = experts.gate_up_proj, experts.down_proj  # [E, 2I, H], [E, H, I], column-major per expert
        method = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}[moe.topk_method]
        bias = self._hold(gate.e_score_correction_bias).data_ptr() if method == 2 else None
        table = _MoE(experts.num_experts, moe.top_k, method, moe.n_group, moe.topk_group, int(moe.norm_topk_prob),
                     experts.intermediate_size, moe.routed_scaling_factor, self._hold(gate.weight.t()).data_ptr(),
                     bias, gate_up.data_ptr(), gate_up.stride(2), gate_up.stride(0), down.data_ptr(), down.stride(2),
                     down.stride(0))
        if moe.shared_experts is not None:
            table.shared_inter = moe.shared_experts.down_proj.in_features
            table.shared_gate_up, table.shared_down = products["gate_up"], products["down"]
        self._moes.append(table)
        return table

    def __call__(self, token: torch.Tensor, kv_start: torch.Tensor | None, length: int) -> torch.Tensor:
        batch = self._step.batch
        if token.shape != (batch, 1) or kv_start is not None and kv_start.shape != (batch,):
            raise ValueError(f"the native decode step was built for {batch} rows of one token: token "
                             f"{tuple(token.shape)}, kv_start {None if kv_start is None else tuple(kv_start.shape)}")
        starts = None if kv_start is None else kv_start.to(torch.int64).contiguous()  # as the C side reads it
        if self.windowed and not _same_starts(starts, self.window_start):
            raise ValueError("kv_start differs from the window_start the window layers' rings were filled with "
                             "(StaticKVCache.set_padding with the prompt's mask)")
        model = self.model
        x = model.model.embed_tokens(token)  # [B, 1, H]: the residual stream, updated in place
        if model.config.embedding_multiplier != 1.0:  # as the model's forward scales it
            x = x * torch.tensor(float(model.config.embedding_multiplier)).to(x.dtype)
        x = x.contiguous()
        status = self._lib.decode_step(self._address, x.data_ptr(), None if starts is None else starts.data_ptr(),
                                       length, torch.get_num_threads())
        if status:
            raise RuntimeError(f"the native decode step refused its arguments (status {status}) at length {length}")
        logits = model.lm_head(model.model.norm(x))
        cap = model.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits


def _same_starts(starts: torch.Tensor | None, window_start: torch.Tensor | None) -> bool:
    """Whether the kv_start of a call is the window_start of the rings (None: every row from column 0)."""
    if starts is None or window_start is None:
        return (starts is None or not bool(starts.any())) and (window_start is None or not bool(window_start.any()))
    return torch.equal(starts, window_start)
