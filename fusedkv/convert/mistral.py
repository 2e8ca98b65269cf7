"""Mistral (transformers' `MistralForCausalLM`).

Weights keep their names. No biases, no QK-norm; `sliding_window`, when set, applies to every layer
(transformers' Mistral ignores `layer_types`).
"""

from __future__ import annotations

from .family import SHAPE, Family, FieldTable, Ignore, Read, read_window


def _every_layer(value, cfg) -> dict:
    return read_window(value, {**cfg, "layer_types": ["sliding_attention"] * cfg["num_hidden_layers"]})


MISTRAL = FieldTable("Mistral", "MistralConfig", {
    **SHAPE,
    "sliding_window": Read(_every_layer),
    "layer_types": Ignore("transformers' Mistral puts its window on every layer whatever layer_types says"),
}, fixed=lambda cfg: {"use_qk_norm": False})

FAMILY = Family(name="Mistral", model_types=("mistral",), config_fields=MISTRAL.read,
                transformers_class="MistralForCausalLM")
