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

ARCHITECTURE = "FusedKVForCausalLM"
MODEL_CLASS = "fusedkv.serving.vllm_model:FusedKVForCausalLM"


def serving_config_class():
    """`FusedKVConfig` with a writable `rope_theta`: vLLM normalises RoPE settings while loading any
    config by assigning `config.rope_theta`, which is a read-only view of `rope_parameters` in the
    project's config."""
    from ..config import FusedKVConfig

    class FusedKVServingConfig(FusedKVConfig):
        @property
        def rope_theta(self) -> float:
            return float(self.rope_parameters["rope_theta"])

        @rope_theta.setter
        def rope_theta(self, value: float) -> None:
            self.rope_parameters = {**self.rope_parameters, "rope_theta": float(value)}

    FusedKVServingConfig.__name__ = FusedKVServingConfig.__qualname__ = "FusedKVServingConfig"
    return FusedKVServingConfig


def check_servable(config) -> None:
    """Raise ValueError naming what the vLLM plugin cannot serve yet (the HF model can)."""
    if "sliding_attention" in config.layer_types:
        raise ValueError("layer_types: sliding-window layers are not served by the vLLM plugin yet (its layers "
                         "take no per-layer window and reconstruction layers do not read window caches); use "
                         "`fusedkv generate`")
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r}: the FusedKV model uses SwiGLU (silu)")
    features = getattr(config, "extra_block_features", list)()  # imported families (fusedkv convert)
    if getattr(config, "kv_lora_rank", None) is not None:  # MLA layers build the model's own RoPE tables (vllm_mla)
        if config.rope_parameters.get("rope_type") == "dynamic":
            raise ValueError("rope_type='dynamic': MLA layers served by the vLLM plugin take fixed RoPE tables; use "
                             "`fusedkv generate`")
        features = [f for f in features if f != "rope_parameters"]
    if features:
        raise ValueError(f"{', '.join(features)}: models with these fields (imported Llama / Mistral / Qwen2 / "
                         "Gemma blocks) are not served by the vLLM plugin yet")


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
