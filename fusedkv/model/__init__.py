"""The FusedKV decoder: layers, fusion weights, attention paths and the transformers model classes."""

from .attention import Attention, KVState
from .fusion import KVFusion
from .modeling import FusedKVForCausalLM, FusedKVModel, FusedKVPreTrainedModel

__all__ = ["Attention", "KVState", "KVFusion", "FusedKVForCausalLM", "FusedKVModel",
           "FusedKVPreTrainedModel"]
