"""Import Hugging Face decoder checkpoints as FusedKV models, or re-plan a vanilla fusedkv one.

With `kv_sharing="vanilla"` the imported model computes exactly what transformers' class for the family
computes; with another plan the reconstruction layers drop their K/V projections and their fusion
weights start from the configured initialisation (paper App. A.3, Table 5): a starting point for
continued training (the paper trains from scratch; a converted model must be trained to recover).

  core.py      read the checkpoint, copy the weights, write the result atomically
  sources.py   a source path (checkpoint directory or GGUF file) -> the checkpoint directory core reads
  family.py    what a family is (`Family`), and `UnsupportedField`
  families.py  the list of families, and `family_for(config)`
  qwen3.py     Qwen3 and Qwen3-MoE          llama.py    Llama 2 / 3 / 3.x
  mistral.py   Mistral                      qwen2.py    Qwen2 / Qwen2.5
  gemma.py     Gemma 2 and Gemma 3 (text)   deepseek.py DeepSeek-V3 and DeepSeek-V2 (MLA, DeepSeekMoE)
"""

from .core import (
    convert_checkpoint,
    convert_qwen3,
    from_qwen3_state,
    fusedkv_to_plan_config,
    load_state_dict,
    model_from_shards,
    model_from_state,
)
from .families import FAMILIES, MODEL_TYPES, family_for
from .family import Family, UnsupportedField
from .qwen3 import FAMILY as _QWEN3
from .sources import open_source, source_directory

# The Hugging Face model types `--distill-from` takes as teachers run by transformers.
QWEN3_MODEL_TYPES = _QWEN3.model_types


def qwen3_to_fusedkv_config(qwen3: dict, kv_sharing: str, **overrides):
    return _QWEN3.to_config(qwen3, kv_sharing, **overrides)


__all__ = ["FAMILIES", "MODEL_TYPES", "Family", "QWEN3_MODEL_TYPES", "UnsupportedField", "convert_checkpoint",
           "convert_qwen3", "family_for", "from_qwen3_state", "fusedkv_to_plan_config", "load_state_dict",
           "model_from_shards", "model_from_state", "open_source", "qwen3_to_fusedkv_config", "source_directory"]
