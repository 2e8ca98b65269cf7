"""The family-independent part of import: read the checkpoint, copy the weights, write the result atomically.

FusedKV's module names are transformers' (Qwen3's), so a family's `prepare_state` maps its tensors onto
them; reconstruction layers drop their K/V projections and K-norm. A vanilla *fusedkv* checkpoint
(model_type fusedkv, e.g. `fusedkv train --plan vanilla`'s final model) converts the same way to any
other plan: the uptraining path (`fusedkv.train.distill`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..checkpoints import check_destination, check_finite_model, write_directory_atomically
from ..config import FusedKVConfig
from ..model import FusedKVForCausalLM
from ..plan import VANILLA
from .families import family_for
from .qwen3 import fuse_experts

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "generation_config.json", "chat_template.jinja")


def fusedkv_to_plan_config(saved: dict, kv_sharing: str, origin: str = "checkpoint", **overrides) -> FusedKVConfig:
    """The config of a fusedkv model with every layer's K/V (plan vanilla, any KV-head count) under another
    plan: same shape, the upper layers' K/V projections dropped. FusedKV keeps Qwen3's weight names, so
    the weights then load as a Qwen3 checkpoint's do (`from_qwen3_state`)."""
    source = FusedKVConfig.from_dict({k: v for k, v in saved.items() if k not in ("model_type", "architectures")})
    if source.kv_sharing != VANILLA:
        raise ValueError(f"{origin} is a {source.kv_sharing!r} model: only a vanilla (full-cache) fusedkv model can "
                         "be converted to another plan; its upper layers' K/V are already gone")
    fields = source.to_dict()
    for k in ("model_type", "architectures", "transformers_version", "kv_sharing", "kv_source_map",
              "shared_attention_types", "torch_dtype", "dtype"):
        fields.pop(k, None)
    fields.update(overrides)
    return FusedKVConfig.from_dict({**fields, "kv_sharing": kv_sharing})


def load_state_dict(src: Path) -> dict[str, torch.Tensor]:
    index = src / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [src / s for s in shards]
    else:
        files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{src} has no *.safetensors weights to convert")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def from_qwen3_state(state: dict[str, torch.Tensor], config: FusedKVConfig, origin: str = "state dict"):
    """A FusedKV model of `config` holding the Qwen3 weights `state` (reconstruction layers drop their
    K/V projections; fusion weights keep their configured initialisation)."""
    state = fuse_experts(dict(state), config)
    if "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied checkpoints store one copy
    model = FusedKVForCausalLM(config)
    expected = model.state_dict()
    allowed_drop = {f"model.layers.{i}.self_attn.{n}" for i in config.plan.reconstruction_layers
                    for n in ("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias", "k_norm.weight",
                              "kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias", "kv_a_layernorm.weight")}
    unexpected = [k for k in state if k not in expected and k not in allowed_drop]
    if unexpected:
        raise ValueError(f"{origin}: weights that a Qwen3 model of this config should not have: {unexpected[:5]}")
    for k, v in state.items():
        if k in expected and v.shape != expected[k].shape:
            raise ValueError(f"{origin}: {k} has shape {tuple(v.shape)}, config implies {tuple(expected[k].shape)}")
    missing = model.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False).missing_keys
    not_fusion = [k for k in missing if ".fusion." not in k]
    if not_fusion:
        raise ValueError(f"{origin}: checkpoint lacks weights {not_fusion[:5]}")
    return model


def convert_qwen3(src, dst, kv_sharing: str = VANILLA, dtype: torch.dtype | None = None, overwrite: bool = False,
                  **overrides) -> FusedKVForCausalLM:
    """Convert the Qwen3 checkpoint directory `src` into a FusedKV checkpoint at `dst`; returns the model.

    `dst` is written whole or not at all: into a temporary directory beside it, renamed into place at the
    end, so a failed conversion (bad weights, a full disk, Ctrl-C) leaves `dst` as it was. A `dst` that
    already holds files is replaced only with `overwrite=True`."""
    src, dst = Path(src), Path(dst)
    check_destination(dst, overwrite, source=src)
    cfg_file = src / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{src} has no config.json; pass a Hugging Face Qwen3 checkpoint directory")
    source_config = json.loads(cfg_file.read_text())
    family = None
    if source_config.get("model_type") == FusedKVConfig.model_type:  # a fusedkv vanilla model: uptraining
        config = fusedkv_to_plan_config(source_config, kv_sharing, origin=str(src), **overrides)
    else:
        family = family_for(source_config)
        config = family.to_config(source_config, kv_sharing, **overrides)
    state = load_state_dict(src)
    if family is not None:
        state = family.prepare_state(state, config)  # the family's names and layouts -> fusedkv's
    model = from_qwen3_state(state, config, origin=str(src))
    check_finite_model(model, str(src))  # NaN/inf weights would convert into a model that computes NaN
    if dtype is not None:
        model = model.to(dtype)

    def write(out: Path) -> None:
        model.save_pretrained(out)
        for name in _TOKENIZER_FILES:
            if (src / name).exists():
                shutil.copy2(src / name, out / name)

    write_directory_atomically(dst, write, overwrite)
    return model
