"""Qwen2 / Qwen2.5 (transformers' `Qwen2ForCausalLM`).

Weights keep their names. Qwen2's attention has biases on Q, K and V but not on O (transformers
hard-codes them: no config field), and no QK-norm; its sliding window applies to the layers
`layer_types` marks, which transformers derives from `use_sliding_window` and `max_window_layers`.
"""

from __future__ import annotations

from .family import SHAPE, WINDOWS, Family, FieldTable, Ignore

QWEN2 = FieldTable("Qwen2", "Qwen2Config", {
    **SHAPE, **WINDOWS,
    "use_sliding_window": Ignore("transformers folds it into layer_types (with max_window_layers)"),
    "max_window_layers": Ignore("transformers folds it into layer_types"),
}, fixed=lambda cfg: {"use_qk_norm": False, "attention_bias": True, "attention_output_bias": False})

FAMILY = Family(name="Qwen2", model_types=("qwen2",), config_fields=QWEN2.read, transformers_class="Qwen2ForCausalLM")
