"""DeepSeek-V3 and DeepSeek-V2 (transformers' `DeepseekV3ForCausalLM`, `DeepseekV2ForCausalLM`).

Multi-head latent attention (`fusedkv/model/mla.py`) and DeepSeekMoE (`fusedkv/model/moe.py`) keep
transformers' module names, so the weights keep their names; per-expert tensors are stacked as for
Qwen3-MoE, and the multi-token-prediction layers some V3 checkpoints append (`model.layers.{L}...`, beyond
`num_hidden_layers`) are dropped, as transformers drops them: they do not take part in the logits.

The config is read as transformers reads it (`DeepseekV3Config.from_dict`: its defaults, and older
`rope_scaling` keys turned into `rope_parameters`), then mapped field by field through `FIELDS`, the one
table of what each field of the two transformers configs (and the keys of DeepSeek's own config.json
that transformers ignores) becomes. A value fusedkv cannot reproduce exactly, or one on which
transformers and DeepSeek's reference code disagree, raises `UnsupportedField` naming it.
"""

from __future__ import annotations

import torch
from transformers import DeepseekV2Config, DeepseekV3Config

from ..config import FusedKVConfig
from .family import COMMON, METADATA, Family, UnsupportedField, unknown_field
from .qwen3 import fuse_experts

V3, V2 = "deepseek_v3", "deepseek_v2"

# What every field becomes. "copy": the FusedKVConfig field of the same name and meaning. "ignored": has no
# effect on the logits in transformers (the reason given). Anything else: the handling, done in
# `deepseek_config_fields` below; the test checks that this table (with family.METADATA and family.COMMON,
# which every family shares) covers every field of transformers' DeepseekV3Config and DeepseekV2Config.
COPY = "copy"
FIELDS: dict[str, str] = {
    **{name: COPY for name in (
        "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
        "num_attention_heads", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
        "n_shared_experts", "num_experts_per_tok", "routed_scaling_factor", "max_position_embeddings",
        "initializer_range", "rms_norm_eps", "tie_word_embeddings", "attention_bias", "attention_dropout",
        "bos_token_id", "eos_token_id", "pad_token_id", "output_router_logits")},
    "n_routed_experts": "num_experts",
    "first_k_dense_replace": "mlp_only_layers = the first first_k_dense_replace layers (dense MLP)",
    "n_group": "n_group (V2: only with topk_method group_limited_greedy, which reads it)",
    "topk_group": "topk_group (as n_group)",
    "topk_method": "V2: topk_method greedy or group_limited_greedy; V3: transformers always routes 'noaux_tc'",
    "scoring_func": "DeepSeek's config.json only: must be V3's 'sigmoid' / V2's 'softmax', which transformers uses",
    "norm_topk_prob": "V3: copied; V2: must be false (transformers' V2 never renormalises)",
    "rope_parameters": "rope_parameters, rope_type default, linear or yarn (YaRN's mscale_all_dim also on the "
                       "MLA softmax scale)",
    "rope_interleave": "rope_interleave (V3; V2 always interleaves)",
    "hidden_act": "must be silu",
    "mlp_bias": "V2: must be false",
    "num_key_value_heads": "must equal num_attention_heads (MLA has no KV-head groups)",
    "head_dim": "derived: qk_rope_head_dim",
    "qk_head_dim": "derived: qk_nope_head_dim + qk_rope_head_dim",
    "moe_layer_freq": "DeepSeek's config.json only: must be 1 (transformers ignores it)",
    "num_mtp_layers": "ignored: multi-token-prediction layers do not take part in the logits; dropped",
    "num_nextn_predict_layers": "ignored: as num_mtp_layers",
    "pretraining_tp": "ignored: transformers' DeepSeek classes do not read it",
    "ep_size": "ignored: expert parallelism, not a property of the function",
    "aux_loss_alpha": "ignored: training loss only (transformers' DeepSeek classes add no auxiliary loss)",
    "seq_aux": "ignored: as aux_loss_alpha",
}
_ROPE_TYPES = ("default", "linear", "yarn")


def _read(hf: dict):
    """The transformers config object, as transformers itself would build it from config.json."""
    cls = DeepseekV3Config if hf["model_type"] == V3 else DeepseekV2Config
    try:
        return cls.from_dict({k: v for k, v in hf.items() if k != "model_type"})
    except (TypeError, ValueError) as e:
        raise ValueError(f"transformers rejects this {hf['model_type']} config: {e}") from None


def _must(field: str, value, ok: bool, why: str) -> None:
    if not ok:
        raise UnsupportedField(field, value, why)


def _classify(hf: dict, tc) -> None:
    """Every field of the config as transformers reads it is in FIELDS, METADATA or COMMON (checked)."""
    for name, value in tc.to_dict().items():
        if name in COMMON:
            COMMON[name].check(name, value)
        elif name not in FIELDS and name not in METADATA:
            raise unknown_field(name, value, "DeepSeek")


def deepseek_config_fields(hf: dict) -> dict:
    v3 = hf["model_type"] == V3
    tc = _read(hf)
    _classify(hf, tc)
    fields = {name: getattr(tc, name) for name, how in FIELDS.items() if how == COPY}
    fields["attention_dropout"] = tc.attention_dropout or 0.0  # V2 allows None
    _must("num_experts_per_tok", tc.num_experts_per_tok, tc.num_experts_per_tok is not None,
          "transformers' router needs the number of experts per token")
    _must("hidden_act", tc.hidden_act, tc.hidden_act == "silu", "fusedkv's MLPs are SwiGLU (silu)")
    _must("mlp_bias", True, not getattr(tc, "mlp_bias", False), "fusedkv's MLPs have no bias")
    _must("num_key_value_heads", tc.num_key_value_heads, tc.num_key_value_heads == tc.num_attention_heads,
          f"with MLA it must equal num_attention_heads={tc.num_attention_heads}")
    _must("moe_layer_freq", hf.get("moe_layer_freq"), hf.get("moe_layer_freq", 1) == 1,
          "transformers makes every layer from first_k_dense_replace on sparse; DeepSeek's code would not")
    scoring = "sigmoid" if v3 else "softmax"
    _must("scoring_func", hf.get("scoring_func"), hf.get("scoring_func", scoring) == scoring,
          f"transformers' {tc.model_type} scores experts by {scoring}")

    rope = dict(tc.rope_parameters)
    rope_type = rope.get("rope_type", "default")
    _must("rope_parameters.rope_type", rope_type, rope_type in _ROPE_TYPES, f"only {', '.join(_ROPE_TYPES)} are")
    fields["rope_parameters"] = rope
    fields["rope_interleave"] = bool(tc.rope_interleave) if v3 else True

    fields["num_experts"] = tc.n_routed_experts
    fields["mlp_only_layers"] = list(range(min(tc.first_k_dense_replace or 0, tc.num_hidden_layers)))
    fields["router_aux_loss_coef"] = 0.0  # transformers' DeepSeek classes add no load-balancing loss
    if v3:
        _must("topk_method", hf.get("topk_method"), hf.get("topk_method", "noaux_tc") == "noaux_tc",
              "transformers' DeepSeek-V3 always routes noaux_tc")
        _must("n_group", tc.n_group, tc.n_group is not None and tc.topk_group is not None,
              "DeepSeek-V3 routing needs n_group and topk_group")
        fields.update(topk_method="noaux_tc", n_group=tc.n_group, topk_group=tc.topk_group,
                      norm_topk_prob=bool(tc.norm_topk_prob))
    else:
        _must("topk_method", tc.topk_method, tc.topk_method in ("greedy", "group_limited_greedy"),
              "transformers' DeepSeek-V2 routes greedy or group_limited_greedy")
        _must("norm_topk_prob", tc.norm_topk_prob, not tc.norm_topk_prob,
              "transformers' DeepSeek-V2 never renormalises the top-k weights (DeepSeek's code would)")
        grouped = tc.topk_method == "group_limited_greedy"
        fields.update(topk_method=tc.topk_method, n_group=tc.n_group if grouped else None,
                      topk_group=tc.topk_group if grouped else None, norm_topk_prob=False)
    return fields


def deepseek_state(state: dict[str, torch.Tensor], config: FusedKVConfig, partial: bool = False
                   ) -> dict[str, torch.Tensor]:
    """Drop the multi-token-prediction layers beyond num_hidden_layers; stack per-expert weights."""
    layers = config.num_hidden_layers

    def main_model(name: str) -> bool:
        parts = name.split(".")
        return not (name.startswith("model.layers.") and int(parts[2]) >= layers)

    return fuse_experts({k: v for k, v in state.items() if main_model(k)}, config, partial)


FAMILY = Family(name="DeepSeek", model_types=(V3, V2), config_fields=deepseek_config_fields,
                prepare_state=deepseek_state, transformers_class="DeepseekV3ForCausalLM, DeepseekV2ForCausalLM")
