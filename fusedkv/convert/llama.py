"""Llama 2 / 3 / 3.1 / 3.2 (transformers' `LlamaForCausalLM`).

The weights keep their names (FusedKV's modules are named as Llama's and Qwen3's). What differs from
Qwen3 is configuration: no QK-norm; `attention_bias` on Q/K/V/O; `mlp_bias`; RoPE scaling of type
llama3, linear or dynamic (through `rope_parameters`, which transformers builds from `rope_scaling`).
"""

from __future__ import annotations

from .family import SHAPE, Copy, Family, FieldTable, Ignore

LLAMA = FieldTable("Llama", "LlamaConfig", {
    **SHAPE,
    "attention_bias": Copy(),
    "mlp_bias": Copy(),
    "pretraining_tp": Ignore("transformers' Llama no longer splits its projections by it: the same function"),
    # nanotron's export flags in SmolLM2's config.json: transformers' Llama reads neither (its RoPE is never
    # interleaved), so the function is the one transformers computes
    "rope_interleaved": Ignore("transformers' Llama does not read it"),
    "is_llama_config": Ignore("transformers' Llama does not read it"),
}, fixed=lambda cfg: {"use_qk_norm": False})

FAMILY = Family(name="Llama", model_types=("llama",), config_fields=LLAMA.read, transformers_class="LlamaForCausalLM")
