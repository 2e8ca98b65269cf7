"""The family-independent part of import: read the checkpoint shard by shard, copy the weights, write the
result atomically.

FusedKV's module names are transformers' (Qwen3's, Llama's), so a family's `prepare_state` maps its tensors
onto them; reconstruction layers drop their K/V projections and K-norm. A vanilla *fusedkv* checkpoint
(model_type fusedkv, e.g. `fusedkv train --plan vanilla`'s final model) converts the same way to any
other plan: the uptraining path (`fusedkv.train.distill`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from ..config import FusedKVConfig
from ..errors import UsageError
from ..model import FusedKVForCausalLM
from ..model.fusion import KVFusion
from ..model_dirs import check_destination, check_finite_model, write_directory_atomically
from ..plan import VANILLA
from .families import MODEL_TYPES, family_for
from .family import with_plan_kv_heads
from .qwen3 import fuse_experts
from .sources import open_source

# The tokenizer travels with the weights, its chat template too (tokenizer_config.json's "chat_template", or
# transformers 5's chat_template.jinja, or the older chat_template.json), so chat requests work on the result.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "tokenizer.model", "added_tokens.json", "generation_config.json",
                    "chat_template.jinja", "chat_template.json")


def fusedkv_to_plan_config(saved: dict, kv_sharing: str, origin: str = "checkpoint", **overrides) -> FusedKVConfig:
    """The config of a fusedkv model with every layer's K/V (plan vanilla, any KV-head count) under another
    plan: same shape, the upper layers' K/V projections dropped. FusedKV keeps Qwen3's weight names, so
    the weights then load as a Qwen3 checkpoint's do (`model_from_state`)."""
    source = FusedKVConfig.from_dict({k: v for k, v in saved.items() if k not in ("model_type", "architectures")})
    if source.kv_sharing != VANILLA:
        raise ValueError(f"{origin} is a {source.kv_sharing!r} model: only a vanilla (full-cache) fusedkv model can "
                         "be converted to another plan; its upper layers' K/V are already gone")
    fields = source.to_dict()
    for k in ("model_type", "architectures", "transformers_version", "kv_sharing", "kv_source_map",
              "shared_attention_types", "torch_dtype", "dtype"):
        fields.pop(k, None)
    fields.update(overrides)
    return FusedKVConfig.from_dict({**with_plan_kv_heads(fields, kv_sharing, overrides), "kv_sharing": kv_sharing})


def shard_files(src: Path) -> list[Path]:
    """The checkpoint's safetensors files, in the index's order when it has one."""
    index = src / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as e:
            raise UsageError(f"{index} is not a safetensors index (no readable weight_map): {e}") from e
        files = [src / s for s in shards]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise UsageError(f"{src}: the index names shards that are not there: {', '.join(missing[:3])}")
    else:
        files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{src} has no *.safetensors weights to convert")
    return files


def read_shard(path: Path) -> dict[str, torch.Tensor]:
    """One safetensors file's tensors; a truncated or corrupt file is a one-line error naming it."""
    try:
        return load_file(str(path))
    except SafetensorError as e:
        raise _incomplete(path, e) from e


def _incomplete(path: Path, e: Exception) -> UsageError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return UsageError(f"{path} is not a complete safetensors file ({first}); it may be truncated: "
                      "download or save it again")


def load_state_dict(src: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint directory `src` at once (conversion itself streams shards instead)."""
    state: dict[str, torch.Tensor] = {}
    for f in shard_files(Path(src)):
        state.update(read_shard(f))
    return state


def model_from_shards(shards: Iterable[dict[str, torch.Tensor]], config: FusedKVConfig, prepare=fuse_experts,
                      origin: str = "state dict") -> FusedKVForCausalLM:
    """A FusedKV model of `config` holding the checkpoint tensors that `shards` yields one shard at a time
    (transformers' names; `prepare` is the family's `prepare_state`). Each shard is copied into the model
    and dropped before the next is read, so memory is the model plus one shard. Reconstruction layers drop
    their K/V projections (and K-norm); fusion weights keep their configured initialisation."""
    model = _unfilled_model(config)
    expected = model.state_dict()
    allowed_drop = {f"model.layers.{i}.self_attn.{n}" for i in config.plan.reconstruction_layers
                    for n in ("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias", "k_norm.weight",
                              "kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias", "kv_a_layernorm.weight")}
    loaded: set[str] = set()
    pending: dict[str, torch.Tensor] = {}  # tensors that wait for the rest of their group (MoE experts)
    with torch.no_grad():
        for shard in shards:
            pending = prepare({**pending, **shard}, config, partial=True)
            for name in [n for n in pending if n in expected]:
                pending[name] = pool_kv_heads(name, pending[name], expected[name].shape, config.head_dim)
                if pending[name].shape != expected[name].shape:
                    raise ValueError(f"{origin}: {name} has shape {tuple(pending[name].shape)}, config implies "
                                     f"{tuple(expected[name].shape)}")
                expected[name].copy_(pending.pop(name))  # and nothing else holds the checkpoint's tensor
                loaded.add(name)
            del shard
        if pending:
            pending = prepare(pending, config, partial=False)  # raises naming what a group lacks
        if "lm_head.weight" not in loaded and "model.embed_tokens.weight" in loaded:
            expected["lm_head.weight"].copy_(expected["model.embed_tokens.weight"])  # tied: stored once
            loaded.add("lm_head.weight")
    unexpected = [k for k in pending if k not in allowed_drop]
    if unexpected:
        raise ValueError(f"{origin}: weights that a model of this config should not have: {unexpected[:5]}")
    missing = [k for k in expected if k not in loaded and ".fusion." not in k]
    if missing:
        raise ValueError(f"{origin}: checkpoint lacks weights {missing[:5]}")
    for module in model.modules():  # the only weights no checkpoint holds: the paper's initialisation (Table 5)
        if isinstance(module, KVFusion):
            model._init_weights(module)
    return model


def pool_kv_heads(name: str, tensor: torch.Tensor, shape: torch.Size, head_dim: int) -> torch.Tensor:
    """A K/V projection (weight or bias) with m times the KV heads the model has (a `PLAN+gqa` import of a
    checkpoint with more KV heads): each group of m consecutive heads mean-pooled into one, the GQA
    uptraining initialisation (Ainslie et al., 2023); query head h then reads pooled head h // (H / H_kv), the
    group whose heads it and its neighbours read before. Other tensors are returned as they are."""
    if not name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_proj.bias",
                          "self_attn.v_proj.bias")) or tensor.shape[1:] != shape[1:] \
            or tensor.shape[0] == shape[0] or tensor.shape[0] % shape[0]:
        return tensor
    heads, m = shape[0] // head_dim, tensor.shape[0] // shape[0]
    return tensor.reshape(heads, m, head_dim, *tensor.shape[1:]).mean(1).reshape(shape).to(tensor.dtype)


def _unfilled_model(config: FusedKVConfig) -> FusedKVForCausalLM:
    """The model with allocated but unset weights: the checkpoint fills them, so drawing random values first
    (as long as the import itself, for a large model) would be wasted. `model_from_shards` refuses to
    return one with a weight left unset."""
    with torch.device("meta"):
        model = FusedKVForCausalLM(config)
    model = model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives tied parameters separate storage
    return model


def model_from_state(state: dict[str, torch.Tensor], config: FusedKVConfig, prepare=fuse_experts,
                     origin: str = "state dict") -> FusedKVForCausalLM:
    """A FusedKV model of `config` holding the transformers-named weights `state` (see `model_from_shards`)."""
    return model_from_shards([dict(state)], config, prepare, origin)


def from_qwen3_state(state: dict[str, torch.Tensor], config: FusedKVConfig, origin: str = "state dict"):
    """`model_from_state` for Qwen3 / Qwen3-MoE / fusedkv weights (the name older code uses)."""
    return model_from_state(state, config, fuse_experts, origin)


def head_differs_from_embeddings(files: list[Path]) -> bool:
    """Whether the checkpoint holds its own `lm_head.weight` with other values than `model.embed_tokens.weight`.
    transformers then keeps the two untied whatever `tie_word_embeddings` says (it warns), so import does too;
    only these two tensors are read."""
    names = ("lm_head.weight", "model.embed_tokens.weight")
    tensors = {}
    for f in files:
        try:
            with safe_open(str(f), "pt") as shard:
                tensors.update({k: shard.get_tensor(k) for k in shard.keys() if k in names})
        except SafetensorError as e:
            raise _incomplete(f, e) from e
    return len(tensors) == 2 and not torch.equal(*tensors.values())


def convert_checkpoint(src, dst, kv_sharing: str = VANILLA, dtype: torch.dtype | None = None,
                       overwrite: bool = False, say=print, **overrides) -> FusedKVForCausalLM:
    """Convert `src` (a checkpoint directory of any family of `families.py`, a vanilla fusedkv model, or a
    GGUF file: `sources.open_source`) into a FusedKV checkpoint at `dst`; returns the model.

    `dst` is written whole or not at all: into a temporary directory beside it, renamed into place at the
    end, so a failed conversion (bad weights, a full disk, Ctrl-C) leaves `dst` as it was. A `dst` that
    already holds files is replaced only with `overwrite=True`. The weights are read one shard at a time."""
    src, dst = Path(src), Path(dst)
    check_destination(dst, overwrite, source=src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    # a GGUF file is imported beside dst, named as write_directory_atomically names its temporary directories
    with open_source(src, workdir=dst.parent, say=say, prefix=f".{dst.name}.tmp-gguf-") as checkpoint:
        return _convert_directory(checkpoint, dst, kv_sharing, dtype, overwrite, **overrides)


def _convert_directory(src: Path, dst: Path, kv_sharing: str, dtype, overwrite: bool, **overrides):
    cfg_file = src / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{src} has no config.json; pass a Hugging Face checkpoint directory "
                         f"(model_type {', '.join(MODEL_TYPES)})")
    try:
        source_config = json.loads(cfg_file.read_text())
    except ValueError as e:
        raise UsageError(f"{cfg_file} is not valid JSON: {e}") from e
    files = shard_files(src)
    if head_differs_from_embeddings(files):
        source_config = {**source_config, "tie_word_embeddings": False}
    if source_config.get("model_type") == FusedKVConfig.model_type:  # a fusedkv vanilla model: uptraining
        config = fusedkv_to_plan_config(source_config, kv_sharing, origin=str(src), **overrides)
        prepare = fuse_experts
    else:
        family = family_for(source_config)
        config = family.to_config(source_config, kv_sharing, **overrides)
        prepare = family.prepare_state
    model = model_from_shards((read_shard(f) for f in files), config, prepare, origin=str(src))
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


convert_qwen3 = convert_checkpoint  # the name older code and tests use
