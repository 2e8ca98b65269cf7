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
from .family import SHAPE, WINDOWS, Copy, Family, FieldTable, Ignore, Require, no

QWEN3 = FieldTable("Qwen3", "Qwen3Config", {
    **SHAPE, **WINDOWS,
    "attention_bias": Copy(),
    "use_sliding_window": Ignore("transformers folds it into layer_types (with max_window_layers)"),
    "max_window_layers": Ignore("transformers folds it into layer_types"),
})
QWEN3_MOE = FieldTable("Qwen3-MoE", "Qwen3MoeConfig", {
    **SHAPE,
    "attention_bias": Copy(),
    "num_local_experts": Copy("num_experts"),  # transformers' stored name for num_experts
    **{name: Copy() for name in ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                                 "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef",
                                 "output_router_logits")},
    "use_sliding_window": Require(no, "sliding-window Qwen3-MoE checkpoints are not imported"),
    "hidden_act": Require(lambda act: act == "silu", "fusedkv's mixture-of-experts layers compute SiLU experts only"),
    "sliding_window": Ignore("used only with use_sliding_window"),
    "max_window_layers": Ignore("used only with use_sliding_window (Qwen3-30B-A3B's config.json carries it)"),
})


def qwen3_config_fields(qwen3: dict) -> dict:
    if qwen3["model_type"] == "qwen3_moe":
        return QWEN3_MOE.read(qwen3)
    return QWEN3.read(qwen3)


def fuse_experts(state: dict[str, torch.Tensor], config: FusedKVConfig, partial: bool = False
                 ) -> dict[str, torch.Tensor]:
    """Stack per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` into the fused 3-D expert tensors.
    `partial`: a layer whose experts are not all in `state` yet (a shard boundary) is left as it is."""
    num_experts = config.num_experts
    prefixes = sorted({k.split(".experts.")[0] for k in state if ".mlp.experts.0.gate_proj.weight" in k})
    for prefix in prefixes:
        names = {p: [f"{prefix}.experts.{e}.{p}.weight" for e in range(num_experts)]
                 for p in ("gate_proj", "up_proj", "down_proj")}
        missing = [n for ns in names.values() for n in ns if n not in state]
        if missing and partial:
            continue
        if missing:
            raise ValueError(f"{prefix}: expert weights missing for num_experts={num_experts}: {missing[:3]}")
        gate, up, down = ([state.pop(n) for n in names[p]] for p in ("gate_proj", "up_proj", "down_proj"))
        state[f"{prefix}.experts.gate_up_proj"] = torch.stack([torch.cat(gu) for gu in zip(gate, up)])
        state[f"{prefix}.experts.down_proj"] = torch.stack(down)
    return state


FAMILY = Family(name="Qwen3", model_types=("qwen3", "qwen3_moe"), config_fields=qwen3_config_fields,
                prepare_state=fuse_experts, transformers_class="Qwen3ForCausalLM, Qwen3MoeForCausalLM")
