"""The model families `fusedkv convert` imports: each listed once here (see `family.py`)."""

from __future__ import annotations

from .deepseek import FAMILY as DEEPSEEK
from .family import Family
from .gemma import FAMILY as GEMMA
from .llama import FAMILY as LLAMA
from .mistral import FAMILY as MISTRAL
from .qwen2 import FAMILY as QWEN2
from .qwen3 import FAMILY as QWEN3

FAMILIES: tuple[Family, ...] = (QWEN3, LLAMA, MISTRAL, QWEN2, GEMMA, DEEPSEEK)
MODEL_TYPES: tuple[str, ...] = tuple(t for f in FAMILIES for t in f.model_types)


def family_for(hf: dict) -> Family:
    """The family of a transformers config dict, by its `model_type`."""
    for family in FAMILIES:
        if hf.get("model_type") in family.model_types:
            return family
    names = ", ".join(f.name for f in FAMILIES)
    raise ValueError(f"expected a {names} checkpoint (model_type {', '.join(MODEL_TYPES)}), "
                     f"got model_type {hf.get('model_type')!r}")
