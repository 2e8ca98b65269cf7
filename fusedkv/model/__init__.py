"""The FusedKV decoder, what the model is: layers, fusion weights and `KVSources`, attention with its reference
implementation, MLA, MoE and the transformers model classes. How it runs fast is `fusedkv.engine`."""

from .attention import Attention, KVState
from .fusion import KVFusion, KVSources
from .modeling import FusedKVForCausalLM, FusedKVModel, FusedKVPreTrainedModel

__all__ = ["Attention", "KVState", "KVFusion", "KVSources", "FusedKVForCausalLM", "FusedKVModel",
           "FusedKVPreTrainedModel"]
