"""The vLLM plugin entry point (`vllm.general_plugins` group in pyproject.toml).

vLLM calls `register()` in every process it starts (API server, engine core, workers), possibly more
than once, so it only registers names. The model module is registered lazily as a string: vLLM
imports it when a checkpoint asks for the `FusedKVForCausalLM` architecture.

Only `fusedkv.config` and `fusedkv.plan` are needed here, never the transformers model: vLLM's
environment has an older transformers in which the project's HF forward does not run.
`check_servable` (what the plugin cannot serve yet) lives here too, free of vLLM imports, so that
`fusedkv serve` can refuse such a checkpoint before starting vLLM.
"""

from __future__ import annotations

import functools
import os

ARCHITECTURE = "FusedKVForCausalLM"
MODEL_CLASS = "fusedkv.serving.vllm_model:FusedKVForCausalLM"


@functools.cache
def serving_config_class():
    """`FusedKVConfig` with a writable `rope_theta`: vLLM normalises RoPE settings while loading any
    config by assigning `config.rope_theta`, which is a read-only view of `rope_parameters` in the
    project's config. One class per process, also this module's attribute `FusedKVServingConfig` (`__getattr__`),
    so that configs pickle into vLLM's engine and tensor-parallel worker processes."""
    from ..config import FusedKVConfig
    from ..plan import FULL

    class FusedKVServingConfig(FusedKVConfig):
        @property
        def rope_theta(self) -> float:
            try:
                return FusedKVConfig.rope_theta.fget(self)  # the full-attention layers' base with a RoPE per type
            except (KeyError, TypeError):
                raise AttributeError("rope_theta") from None  # not set yet: transformers then takes its default

        @rope_theta.setter
        def rope_theta(self, value: float) -> None:
            params = self.rope_parameters
            if FULL in params:  # one RoPE per attention type (Gemma 3): the base vLLM reads is the global one
                self.rope_parameters = {**params, FULL: {**params[FULL], "rope_theta": float(value)}}
            else:
                self.rope_parameters = {**params, "rope_theta": float(value)}

    FusedKVServingConfig.__name__ = FusedKVServingConfig.__qualname__ = "FusedKVServingConfig"
    return FusedKVServingConfig


def __getattr__(name: str):
    if name == "FusedKVServingConfig":  # built on first use: importing this module must stay cheap
        return serving_config_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# How sparse MoE layers run under vLLM (`vllm_moe`): vLLM's FusedMoE (the default) or the model's own SparseMoE.
MOE_ENV = "FUSEDKV_VLLM_MOE"
MOE_PATHS = ("fused", "exact")


def requested_moe_path() -> str:
    """$FUSEDKV_VLLM_MOE ("fused" when unset); ValueError naming the variable for any other value."""
    chosen = os.environ.get(MOE_ENV) or MOE_PATHS[0]
    if chosen not in MOE_PATHS:
        raise ValueError(f"{MOE_ENV}={chosen!r}: choose 'fused' (vLLM's FusedMoE, the default) or 'exact' (the "
                         "model's own SparseMoE as one custom op)")
    return chosen


def check_servable(config) -> None:
    """Raise ValueError naming what the vLLM plugin cannot serve yet (the HF model can)."""
    if getattr(config, "num_experts", 0):
        requested_moe_path()  # a mistyped path is refused before vLLM starts, not after its start-up
    if getattr(config, "kv_lora_rank", None) is not None and config.rope_parameters.get("rope_type") == "dynamic":
        raise ValueError("rope_type='dynamic': MLA layers served by the vLLM plugin take fixed RoPE tables (vllm_mla "
                         "builds the model's own); use `fusedkv generate`")


_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AutoConfig
    from vllm import ModelRegistry

    AutoConfig.register("fusedkv", serving_config_class(), exist_ok=True)
    ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    _registered = True
