"""fusedkv: decoder language models with half-size KV caches by cross-layer fusion (arXiv:2512.03870).

`import fusedkv` registers the model with transformers, so `AutoConfig`, `AutoModel` and
`AutoModelForCausalLM` resolve `model_type: fusedkv` checkpoints.
"""

from importlib.metadata import PackageNotFoundError, version

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .config import FusedKVConfig
from .model import FusedKVForCausalLM, FusedKVModel
from .plan import PLAN_NAMES, KVSharingPlan, LayerKV, build_plan
from .source_map import custom_plan

AutoConfig.register("fusedkv", FusedKVConfig, exist_ok=True)
AutoModel.register(FusedKVConfig, FusedKVModel, exist_ok=True)
AutoModelForCausalLM.register(FusedKVConfig, FusedKVForCausalLM, exist_ok=True)

try:  # the one version number is pyproject.toml's, as installed
    __version__ = version("fusedkv")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
__all__ = ["FusedKVConfig", "FusedKVForCausalLM", "FusedKVModel", "KVSharingPlan", "LayerKV", "PLAN_NAMES",
           "build_plan", "custom_plan"]
