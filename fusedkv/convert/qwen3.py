"""Qwen3 and Qwen3-MoE (transformers' `Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`).

FusedKV's module names are Qwen3's, so the weights keep their names. Qwen3-MoE: `num_local_experts` is
transformers' stored name for `num_experts`, and the per-expert weights that `save_pretrained` writes
(`mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`) are stacked into the fused 3-D tensors the model
keeps (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]); checkpoints that
already hold the fused tensors load as they are.
"""

from __future__ import annotations

import torch

from ..config import FusedKVConfig
from .family import Family, UnsupportedField

# Qwen3 config fields carried over verbatim.
_QWEN3_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "initializer_range",
    "tie_word_embeddings", "attention_bias", "bos_token_id", "eos_token_id", "pad_token_id",
)
# Qwen3-MoE's extra fields (transformers' names; num_experts handled separately).
_QWEN3_MOE_FIELDS = (
    "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
    "router_aux_loss_coef", "output_router_logits",
)


def qwen3_config_fields(qwen3: dict) -> dict:
    if qwen3.get("use_sliding_window"):
        raise UnsupportedField("use_sliding_window", True, "sliding-window Qwen3 checkpoints are not imported yet")
    rope = qwen3.get("rope_parameters") or {"rope_type": "default", "rope_theta": qwen3.get("rope_theta", 10000.0)}
    if rope.get("rope_type", "default") != "default":
        raise UnsupportedField("rope_parameters.rope_type", rope.get("rope_type"), "only the default RoPE is")
    fields = {k: qwen3[k] for k in _QWEN3_FIELDS if k in qwen3}
    fields["rope_parameters"] = {"rope_type": "default", "rope_theta": float(rope["rope_theta"])}
    if qwen3["model_type"] == "qwen3_moe":
        fields.update({k: qwen3[k] for k in _QWEN3_MOE_FIELDS if k in qwen3})
        fields["num_experts"] = qwen3.get("num_experts", qwen3.get("num_local_experts", 128))
    return fields


def fuse_experts(state: dict[str, torch.Tensor], config: FusedKVConfig) -> dict[str, torch.Tensor]:
    """Stack per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` into the fused 3-D expert tensors."""
    num_experts = config.num_experts
    prefixes = sorted({k.split(".experts.")[0] for k in state if ".mlp.experts.0.gate_proj.weight" in k})
    for prefix in prefixes:
        names = {p: [f"{prefix}.experts.{e}.{p}.weight" for e in range(num_experts)]
                 for p in ("gate_proj", "up_proj", "down_proj")}
        missing = [n for ns in names.values() for n in ns if n not in state]
        if missing:
            raise ValueError(f"{prefix}: expert weights missing for num_experts={num_experts}: {missing[:3]}")
        gate, up, down = ([state.pop(n) for n in names[p]] for p in ("gate_proj", "up_proj", "down_proj"))
        state[f"{prefix}.experts.gate_up_proj"] = torch.stack([torch.cat(gu) for gu in zip(gate, up)])
        state[f"{prefix}.experts.down_proj"] = torch.stack(down)
    return state


FAMILY = Family(name="Qwen3", model_types=("qwen3", "qwen3_moe"), config_fields=qwen3_config_fields,
                prepare_state=fuse_experts)
