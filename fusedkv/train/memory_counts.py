"""What a training run holds, counted for this model and trainer: its parameters (built on the meta device),
the tensors autograd saves per token in each layer, and an uptraining teacher's size and per-token bytes.

`fusedkv.train.memory_estimate` adds them up into bytes per GPU for a parallel layout; the counting rules
and their references are in its docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import FusedKVConfig
from ..model.moe import is_sparse_layer
from .config import TrainConfig


def model_config(cfg: TrainConfig) -> FusedKVConfig:
    """The FusedKVConfig a run of `cfg` trains (the preset's dimensions, the plan, the vocabulary)."""
    mc = cfg.model_config()  # the trainer's own: the plan read once, by the model config
    mc.max_position_embeddings = max(mc.max_position_embeddings, cfg.seq_len)
    return mc


@dataclass
class ParamCount:
    total: int
    root: int  # embeddings, final norm, LM head: FSDP2's root unit
    largest_layer: int
    decayed: int  # 2-D weight matrices: the larger AdamW group (one foreach temporary per group)
    non_embedding: int  # everything but the embedding table
    active: int = 0  # non_embedding with only the experts a token visits (the "N" of 6N FLOPs per token)


def count_parameters(mc: FusedKVConfig) -> ParamCount:
    """Exact parameter counts, from the model built on the meta device (nothing is allocated)."""
    from ..model import FusedKVForCausalLM

    with torch.device("meta"):
        model = FusedKVForCausalLM(mc)
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    total = sum(p.numel() for p in model.parameters())
    decayed = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    embed = model.model.embed_tokens.weight.numel()
    return ParamCount(total, total - sum(layers), max(layers), decayed, total - embed,
                      active_parameters(model, mc.num_experts, mc.num_experts_per_tok))


def active_parameters(model, num_experts: int, top_k: int) -> int:
    """Parameters but the embedding table, the routed experts' counted at top_k / num_experts (a token
    visits k of them). Routed experts are the parameters under an `experts` module (fusedkv's fused
    tensors, transformers' per-expert lists), not `shared_experts`."""
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in f".{n}" and "shared" not in n)
    embed = model.get_input_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters()) - embed
    return int(total - routed + (routed * top_k / num_experts if num_experts else 0))


# ---- activations -----------------------------------------------------------------------------------
def _new_kv_tensors(layer) -> int:
    """K/V tensors a reconstruction layer creates (and saves for SDPA): a side that reuses a single
    source as it is makes none; a weighted or multi-source fusion makes one."""
    return sum(
        0 if (mode == "reuse" and len(sources) == 1) else 1
        for mode, sources in ((layer.k_fusion, layer.k_sources), (layer.v_fusion, layer.v_sources))
    )


def activation_bytes_per_token(mc: FusedKVConfig, dtype: str = "float32", checkpointing: bool = False) -> dict:
    """Bytes autograd keeps per token of one micro-batch until backward: {"layers", "head", "total"}.

    fp32: every saved tensor has 4 bytes per element. bf16 autocast: the residual stream, RMSNorm
    (run in fp32) and the loss stay fp32; projections, RoPE'd Q/K, V and attention outputs are bf16."""
    h, a, g, d, i, V = (mc.hidden_size, mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim,
                        mc.intermediate_size, mc.vocab_size)
    ad, gd = a * d, g * d
    bf16 = dtype == "bfloat16"
    # RMSNorm over the residual stream: input, 1/rms, normalised input (all fp32), output (the next
    # projection's input: fp32, or its bf16 cast under autocast).
    norm = 4 * (3 * h + 1) if not bf16 else 4 * (2 * h + 1) + 2 * h
    act = 4 if not bf16 else 2  # bytes of a projection-output element
    # Q (or K): projection output (fp32 copy under autocast), 1/rms, normalised; then the RoPE'd copy.
    qk_norm = (lambda w: 4 * (2 * w) + 4 * (w // d)) if bf16 else (lambda w: 4 * (2 * w + w // d))
    small_norm = (lambda w: 4 * (3 * w + 1)) if not bf16 else (lambda w: 4 * (2 * w + 1) + 2 * w)  # as `norm`

    def swiglu(width: int) -> int:  # gate, up, silu(gate), silu(gate) * up
        return 4 * act * width

    def mlp(index: int) -> int:
        if not is_sparse_layer(mc, index):
            return swiglu(i)
        E, k = mc.num_experts, mc.num_experts_per_tok
        shared = getattr(mc, "n_shared_experts", 0) or 0
        # router logits and probabilities (fp32); per visited expert: gathered input, SwiGLU, output
        return 4 * 2 * E + k * (act * h + swiglu(mc.moe_intermediate_size) + act * h) + swiglu(
            shared * mc.moe_intermediate_size)

    mla = mc.kv_lora_rank is not None
    if mla:
        nope, rope, vd, r = mc.qk_nope_head_dim, mc.qk_rope_head_dim, mc.v_head_dim, mc.kv_lora_rank
        qd = a * (nope + rope)
        q_path = (act * mc.q_lora_rank + small_norm(mc.q_lora_rank) if mc.q_lora_rank else 0) + act * qd
        # query: (low-rank path), projection, RoPE'd; SDPA output, log-sum-exp, o_proj input
        attn_common = q_path + act * qd + act * a * vd + 4 * a + act * a * vd
        # storage layer: latent + RoPE key (kv_a_proj), latent norm, kv_b_proj's per-head K/V, RoPE'd key
        attn_store = act * (r + rope) + small_norm(r) + act * a * (nope + vd) + act * (qd + rope)
        attn_fused = small_norm(r) + act * a * (nope + vd) + act * (qd + rope)  # from fused (c, k_R)
    per_layer = []
    stored_kv = 0
    for index, layer in enumerate(mc.plan.layers):
        b = 2 * norm + mlp(index)
        if mla:
            b += attn_common + (attn_store if layer.stores else attn_fused + act * (r + rope))
            stored_kv += act * (r + rope) if layer.stores else 0
            per_layer.append(b)
            continue
        b += qk_norm(ad) + act * ad  # q: normed (+ its input and 1/rms), RoPE'd
        b += act * ad + 4 * a + act * ad  # SDPA output, log-sum-exp (fp32), o_proj's contiguous input
        if layer.stores:
            b += qk_norm(gd) + act * gd + act * gd  # k: normed, RoPE'd; v
            stored_kv += 2 * act * gd
        else:
            b += _new_kv_tensors(layer) * act * gd
        per_layer.append(b)
    rope_tables = 2 * (mc.qk_rope_head_dim if mla else d) * 4  # cos and sin (fp32, shared by every layer)
    head = norm + 4 * V + 8  # final norm, fp32 log-softmax over the vocabulary, input ids (int64)
    if checkpointing:
        # Each layer keeps its input (residual stream, fp32); the storage layers' K/V stay alive in the
        # forward's KVState for the upper layers. One layer is recomputed at a time in backward.
        layers_total = mc.num_hidden_layers * 4 * h + stored_kv
        recompute = max(per_layer)
    else:
        layers_total = sum(per_layer)
        recompute = 0
    total = layers_total + rope_tables + head
    return {"layers": layers_total, "head": head + rope_tables, "total": total, "recompute_layer": recompute,
            "largest_layer": max(per_layer)}


# ---- the teacher (uptraining) ----------------------------------------------------------------------
@dataclass
class Teacher:
    """The model distilled from when uptraining: its size as transformers builds it, and its shape."""

    name: str  # transformers' class
    params: ParamCount
    config: FusedKVConfig  # its shape (the source as a vanilla fusedkv model), for the activations
    dtype_bytes: int  # 2 (bf16/fp16) or 4 (fp32)
    hidden: bool = False  # hidden-state distillation keeps its hidden states


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def count_teacher(src, config: FusedKVConfig, dtype: str = "auto", hidden: bool = False) -> Teacher:
    """The teacher of an uptraining run from SRC's config.json alone: transformers' own class built on the
    meta device (exact parameter count, nothing allocated or read but the config). dtype "auto" is the
    checkpoint's (`dtype` / `torch_dtype`, bfloat16 if it says none): how `fusedkv.train.distill` loads a
    teacher on a GPU (float32 on CPU)."""
    import json
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.from_pretrained(str(src))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    if dtype == "auto":
        saved = json.loads((Path(src) / "config.json").read_text())
        dtype = str(saved.get("dtype") or saved.get("torch_dtype") or "bfloat16")
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"teacher dtype {dtype!r}: choose one of {', '.join(_DTYPE_BYTES)}")
    total = sum(p.numel() for p in model.parameters())
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    experts = getattr(hf, "num_experts", None) or getattr(hf, "n_routed_experts", None) or 0
    params = ParamCount(total, total - sum(layers), max(layers), 0,
                        total - model.get_input_embeddings().weight.numel(),
                        active_parameters(model, experts, getattr(hf, "num_experts_per_tok", 0) or 0))
    return Teacher(type(model).__name__, params, config, _DTYPE_BYTES[dtype], hidden)


def teacher_bytes(teacher: Teacher, tokens: int) -> dict:
    """Per-GPU bytes of a teacher for `tokens` tokens per micro-batch: {"weights", "forward", "distill",
    "loss_buffers"} (see the module docstring)."""
    tc, tb = teacher.config, teacher.dtype_bytes
    layer = activation_bytes_per_token(tc, "bfloat16" if tb == 2 else "float32")["largest_layer"]
    V = tc.vocab_size
    hidden = (tc.num_hidden_layers + 1) * tc.hidden_size * tb if teacher.hidden else 0
    return {
        "weights": teacher.params.total * tb,
        # one layer's tensors at a time, then its logits and their fp32 copy
        "forward": tokens * (max(layer, tb * V + 4 * V) + hidden),
        # saved for backward: the student's tempered log-softmax and the teacher's log-probabilities
        "distill": tokens * (2 * 4 * V + hidden),
        "loss_buffers": tokens * 2 * 4 * V,  # the KL's backward: the gradient and its softmax backward
    }
