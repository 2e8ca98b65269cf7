"""Gemma 2 and Gemma 3 text models (transformers' `Gemma2ForCausalLM`, `Gemma3ForCausalLM`).

What the Gemma block computes, as fusedkv config fields: RMSNorm x / rms(x) * (1 + w)
(`rms_norm_unit_offset`); a norm on the attention output and on the MLP output before each residual add
(`use_post_norms`); scores scaled by `query_pre_attn_scalar`^-1/2; embeddings times sqrt(hidden_size)
rounded to their dtype (`embedding_multiplier`); a GeGLU MLP (`hidden_activation`, usually tanh-GELU); the
local/global layer pattern (`layer_types`, `sliding_window`). Gemma 3 adds QK-norm and a separate RoPE
base for its local layers (`rope_parameters` per attention type); Gemma 2 soft-caps the attention scores
(`attn_logit_softcapping`). Both may soft-cap the final logits (`final_logit_softcapping`).

Weight names: Gemma's `post_attention_layernorm` normalises the attention *output*, while fusedkv's (Qwen3's)
is the norm before the MLP, Gemma's `pre_feedforward_layernorm`; the two are renamed here.
"""

from __future__ import annotations

import torch

from ..config import FusedKVConfig
from .family import SHAPE, WINDOWS, Copy, Family, FieldTable, Ignore, Read, Require, no, read_activation

_GEMMA = {
    **SHAPE, **WINDOWS,
    "hidden_activation": Read(read_activation),
    "attention_bias": Copy(),
    "query_pre_attn_scalar": Copy(),
    "final_logit_softcapping": Copy(),
    "use_bidirectional_attention": Require(no, "bidirectional (encoder-style) attention is not a decoder"),
}


def _gemma_block(cfg: dict) -> dict:
    return {"rms_norm_unit_offset": True, "use_post_norms": True, "embedding_multiplier": cfg["hidden_size"] ** 0.5}


GEMMA2 = FieldTable("Gemma 2", "Gemma2Config", {**_GEMMA, "attn_logit_softcapping": Copy()},
                    fixed=lambda cfg: {**_gemma_block(cfg), "use_qk_norm": False})
GEMMA3 = FieldTable("Gemma 3", "Gemma3TextConfig", {
    **_GEMMA,
    "attn_logit_softcapping": Ignore("transformers' Gemma 3 attention does not apply it"),
    "_sliding_window_pattern": Ignore("transformers folds it into layer_types"),
    "sliding_window_pattern": Ignore("transformers folds it into layer_types"),
}, fixed=lambda cfg: {**_gemma_block(cfg), "use_qk_norm": True})


def gemma_config_fields(hf: dict) -> dict:
    return (GEMMA2 if hf["model_type"] == "gemma2" else GEMMA3).read(hf)


_RENAMES = (("post_attention_layernorm", "post_attention_output_layernorm"),
            ("pre_feedforward_layernorm", "post_attention_layernorm"))


def gemma_state(state: dict[str, torch.Tensor], config: FusedKVConfig, partial: bool = False
                ) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        for old, new in _RENAMES:
            if name.endswith(f".{old}.weight") and ".layers." in name:
                name = name[: -len(f"{old}.weight")] + f"{new}.weight"
                break
        out[name] = tensor
    return out


FAMILY = Family(name="Gemma", model_types=("gemma2", "gemma3_text"), config_fields=gemma_config_fields,
                prepare_state=gemma_state, transformers_class="Gemma2ForCausalLM, Gemma3ForCausalLM")
