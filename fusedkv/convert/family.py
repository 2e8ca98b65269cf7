"""What one imported model family is to `fusedkv convert`: its Hugging Face model types and the function
from its transformers config (a dict, as config.json holds it) to a `FusedKVConfig`.

Each family lives in its own module of this package (`qwen3.py`, ...) as a module-level `FAMILY`, and is
listed once in `families.py`. A family reads every config field that changes the function the checkpoint
computes and refuses, with `UnsupportedField`, any value fusedkv cannot reproduce exactly: nothing is
imported approximately.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import FusedKVConfig


class UnsupportedField(ValueError):
    """A checkpoint uses a config field (or value) that fusedkv cannot reproduce exactly."""

    def __init__(self, field: str, value, why: str = ""):
        self.field = field
        super().__init__(f"config field {field}={value!r} is not supported" + (f": {why}" if why else ""))


def _same_state(state: dict[str, torch.Tensor], config: FusedKVConfig) -> dict[str, torch.Tensor]:
    return state


@dataclass(frozen=True)
class Family:
    name: str  # as users know it, for messages: "Qwen3", "Llama", ...
    model_types: tuple[str, ...]  # transformers' `model_type` values this family imports
    # transformers config dict -> FusedKVConfig keyword arguments (without kv_sharing); raises UnsupportedField
    config_fields: Callable[[dict], dict]
    # the checkpoint's tensors (transformers' names) -> fusedkv's names and layouts, for a model of `config`
    prepare_state: Callable[[dict[str, torch.Tensor], FusedKVConfig], dict[str, torch.Tensor]] = _same_state

    def to_config(self, hf: dict, kv_sharing: str, **overrides) -> FusedKVConfig:
        if hf.get("model_type") not in self.model_types:
            types = " or ".join(map(repr, self.model_types))
            got = hf.get("model_type")
            raise ValueError(f"expected a {self.name} checkpoint (model_type {types}), got model_type {got!r}")
        return FusedKVConfig(**self.config_fields(hf), kv_sharing=kv_sharing, **overrides)
