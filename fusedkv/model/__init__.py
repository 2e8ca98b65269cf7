"""The FusedKV decoder: layers, fusion weights, attention paths and the transformers model classes."""

from .attention import ATTENTION_PATHS, Attention, KVState
from .fusion import KVFusion
from .modeling import FusedKVForCausalLM, FusedKVModel, FusedKVPreTrainedModel
from .packing import is_packed, pack_for_decode, unpack_weights

__all__ = ["ATTENTION_PATHS", "Attention", "KVState", "KVFusion", "FusedKVForCausalLM", "FusedKVModel",
           "FusedKVPreTrainedModel", "is_packed", "pack_for_decode", "unpack_weights"]
