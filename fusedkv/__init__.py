"""fusedkv: decoder language models with half-size KV caches by cross-layer fusion (arXiv:2512.03870).

`import fusedkv` registers the model with transformers, so `AutoConfig`, `AutoModel` and
`AutoModelForCausalLM` resolve `model_type: fusedkv` checkpoints.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .config import FusedKVConfig
from .model import FusedKVForCausalLM, FusedKVModel
from .plan import PLAN_NAMES, KVSharingPlan, LayerKV, build_plan, custom_plan

AutoConfig.register("fusedkv", FusedKVConfig, exist_ok=True)
AutoModel.register(FusedKVConfig, FusedKVModel, exist_ok=True)
AutoModelForCausalLM.register(FusedKVConfig, FusedKVForCausalLM, exist_ok=True)

__version__ = "0.1.0"
__all__ = ["FusedKVConfig", "FusedKVForCausalLM", "FusedKVModel", "KVSharingPlan", "LayerKV", "PLAN_NAMES",
           "build_plan", "custom_plan"]
