"""The native decode step's tables (`fusedkv/kernels/cpu_decode_step.c`): its structs, field for field, and the
description of each product as the engine laid it out (`fusedkv.engine.packing` / `precision`), which
`fusedkv.engine.native_step` fills once when it builds the step."""

from __future__ import annotations

import ctypes

import torch

from ..kernels import cpu_gemv
from ..model.mla import MLA
from ..model.moe import SparseMoE
from .packing import decode_products
from .precision import ReducedLinear

P, I, L, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
# the weight layouts of `Product` in cpu_decode_step.c
W_F32, W_BF16_BLOCKS, W_INT8_BLOCKS, W_INT4_BLOCKS, W_F16_BLOCKS = 0, 1, 2, 3, 4


class _Product(ctypes.Structure):  # `Product` in cpu_decode_step.c, field for field
    _fields_ = [("fmt", I), ("in_", I), ("in_padded", I), ("out", I), ("w", P), ("ld", L), ("scale", P), ("bias", P)]


class _MoE(ctypes.Structure):  # `MoE` in cpu_decode_step.c
    _fields_ = [("n_experts", I), ("top_k", I), ("method", I), ("n_group", I), ("topk_group", I), ("norm_topk", I),
                ("inter", I), ("routed_scaling", F), ("gate", P), ("score_bias", P), ("gate_up", P), ("gu_ld", L),
                ("gu_es", L), ("down", P), ("d_ld", L), ("d_es", L), ("shared_inter", I),
                ("shared_gate_up", _Product), ("shared_down", _Product)]


class _Mla(ctypes.Structure):  # `Mla` in cpu_decode_step.c
    _fields_ = [("heads", I), ("nope", I), ("rope", I), ("v_dim", I), ("rank", I), ("q_lora", I), ("interleave", I),
                ("q_a", _Product), ("q_a_norm", P), ("q", _Product), ("kv_a", _Product), ("kv_a_norm", P),
                ("kv_b", P), ("a", P), ("q_out", P)]


class _Layer(ctypes.Structure):  # `StepLayer`
    _fields_ = [("stores", I), ("window", I), ("attn_norm", P), ("mlp_norm", P), ("post_attn_norm", P),
                ("post_mlp_norm", P), ("cos", P), ("sin", P), ("proj", _Product), ("q_norm", P), ("k_norm", P),
                ("k_cache", P), ("v_cache", P), ("k_pend", P), ("v_pend", P), ("n_k", I), ("n_v", I),
                ("k_src", P * 2), ("v_src", P * 2), ("k_pend_src", P * 2), ("v_pend_src", P * 2),
                ("k_w", P * 2), ("v_w", P * 2), ("k_w_hs", L), ("v_w_hs", L),
                ("o", _Product), ("gate_up", _Product), ("down", _Product), ("moe", ctypes.POINTER(_MoE)),
                ("mla", ctypes.POINTER(_Mla))]


class _Step(ctypes.Structure):  # `Step` in cpu_decode_step.c
    _fields_ = [("n_layers", I), ("hidden", I), ("n_heads", I), ("n_kv_heads", I), ("head_dim", I), ("inter", I),
                ("batch", I), ("kind", I), ("act_kind", I), ("cache_len", L), ("eps", F), ("scale", F),
                ("softcap", F), ("layers", ctypes.POINTER(_Layer)),
                ("h", P), ("proj", P), ("q", P), ("attn", P), ("attn2", P), ("lse", P), ("lse2", P), ("gu", P),
                ("act", P), ("ring_start", P), ("xb", P),
                ("m_scores", P), ("m_choice", P), ("m_x", P), ("m_gu", P), ("m_act", P), ("m_y", P), ("m_out", P),
                ("m_idx", P), ("m_w", P), ("kivi", P)]


def _product(module) -> _Product | None:
    """The native description of one product (a projection, or a packed group of them), or None when its
    weight is in no layout the native products read: f32 in the decode layout, bf16 / f16 / int8 blocks, or int4
    blocks whose outputs are whole blocks (the step lays the outputs of one product side by side)."""
    weight, bias = module.weight, module.bias
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    if isinstance(module, ReducedLinear):
        if not module.blocked or module.out_features != weight.shape[0] * cpu_gemv.BLOCK:  # padded: not laid out
            return None
        if module.fmt == "int4":
            return _Product(W_INT4_BLOCKS, module.in_features, weight.shape[1] * cpu_gemv.GROUP, module.out_features,
                            weight.data_ptr(), weight.stride(0), module.scale.data_ptr(),
                            None if bias is None else bias.data_ptr())
        fmt = {"int8": W_INT8_BLOCKS, "float16": W_F16_BLOCKS}.get(module.fmt, W_BF16_BLOCKS)
        scale = module.scale.data_ptr() if fmt == W_INT8_BLOCKS else None
        return _Product(fmt, module.in_features, 2 * weight.shape[1], module.out_features, weight.data_ptr(),
                        weight.stride(0), scale, None if bias is None else bias.data_ptr())
    if weight.dtype != torch.float32 or weight.stride(0) != 1:
        return None
    return _Product(W_F32, weight.shape[1], weight.shape[1], weight.shape[0], weight.data_ptr(), weight.stride(1),
                    None, None if bias is None else bias.data_ptr())


def _products(layer) -> dict[str, _Product] | None:
    """The native descriptions of a decoder layer's products as the engine laid them out
    (`fusedkv.engine.packing.decode_products`: the packed group, or a reduced group's one module), or None
    when one is in no layout the step reads. A sparse MLP's shared experts count as the MLP (none: none)."""
    attn = _mla_products(layer.self_attn) if isinstance(layer.self_attn, MLA) else decode_products(layer.self_attn)
    mlp = layer.mlp.shared_experts if isinstance(layer.mlp, SparseMoE) else layer.mlp
    mlp = decode_products(mlp) if mlp is not None else {}
    if attn is None or mlp is None:
        return None
    modules = {"proj": attn["q_proj"], "o": attn["o_proj"]} if "proj" not in attn else dict(attn)
    if mlp:
        modules.update(gate_up=mlp["gate_proj"], down=mlp["down_proj"])
    products = {name: _product(m) for name, m in modules.items()}
    return None if None in products.values() else products


def _mla_products(attn: MLA) -> dict[str, torch.nn.Module]:
    """An MLA layer's projections the step multiplies, under the step's names ("proj" stands for the query
    product, q_proj or q_b_proj; "o" the output)."""
    names = {"proj": "q_proj" if attn.q_lora_rank is None else "q_b_proj", "q_a": "q_a_proj",
             "kv_a": "kv_a_proj_with_mqa", "o": "o_proj"}
    return {key: getattr(attn, name) for key, name in names.items() if hasattr(attn, name)}
