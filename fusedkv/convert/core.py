"""Import a Hugging Face Qwen3 or Qwen3-MoE checkpoint as a FusedKV model (or re-plan a vanilla fusedkv one).

FusedKV's module names are Qwen3's, so conversion is a renaming-free copy: every weight keeps its
name, reconstruction layers drop their K/V projections and K-norm, and their fusion weights start
from the configured initialisation (paper App. A.3, Table 5). With `kv_sharing="vanilla"` the result computes
exactly what transformers' `Qwen3ForCausalLM` computes; with another plan it is a starting point for
continued training (the paper trains from scratch; a converted model must be trained to recover).
A vanilla *fusedkv* checkpoint (model_type fusedkv, e.g. `fusedkv train --plan vanilla`'s final model)
converts the same way to any other plan: the uptraining path (`fusedkv.train.distill`).

Qwen3-MoE: the config's MoE fields carry over (`num_local_experts` is transformers' stored name for
`num_experts`), and the per-expert weights that `save_pretrained` writes
(`mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`) are stacked into the fused 3-D tensors the
model keeps (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]); checkpoints
that already hold the fused tensors load as they are.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from .config import FusedKVConfig
from .errors import RunError, UsageError
from .model import FusedKVForCausalLM
from .plan import VANILLA

# Qwen3 config fields carried over verbatim.
_QWEN3_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "initializer_range",
    "tie_word_embeddings", "attention_bias", "bos_token_id", "eos_token_id", "pad_token_id",
)
# Qwen3-MoE's extra fields (transformers' names; num_experts handled separately).
_QWEN3_MOE_FIELDS = (
    "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
    "router_aux_loss_coef", "output_router_logits",
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "generation_config.json", "chat_template.jinja")


# The Hugging Face model types this module imports (and `--distill-from` takes as teachers).
QWEN3_MODEL_TYPES = ("qwen3", "qwen3_moe")


def qwen3_to_fusedkv_config(qwen3: dict, kv_sharing: str, **overrides) -> FusedKVConfig:
    if qwen3.get("model_type") not in QWEN3_MODEL_TYPES:
        got = qwen3.get("model_type")
        raise ValueError(f"expected a Qwen3 checkpoint (model_type 'qwen3' or 'qwen3_moe'), got model_type {got!r}")
    if qwen3.get("use_sliding_window"):
        raise ValueError("Qwen3 checkpoints with use_sliding_window=true are not supported yet")
    rope = qwen3.get("rope_parameters") or {"rope_type": "default", "rope_theta": qwen3.get("rope_theta", 10000.0)}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {rope.get('rope_type')!r} is not supported; only the default RoPE is")
    fields = {k: qwen3[k] for k in _QWEN3_FIELDS if k in qwen3}
    fields["rope_parameters"] = {"rope_type": "default", "rope_theta": float(rope["rope_theta"])}
    if qwen3["model_type"] == "qwen3_moe":
        fields.update({k: qwen3[k] for k in _QWEN3_MOE_FIELDS if k in qwen3})
        fields["num_experts"] = qwen3.get("num_experts", qwen3.get("num_local_experts", 128))
    return FusedKVConfig(**fields, kv_sharing=kv_sharing, **overrides)


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
    state = _fuse_experts(dict(state), config.num_experts)
    if "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied checkpoints store one copy
    model = FusedKVForCausalLM(config)
    expected = model.state_dict()
    allowed_drop = {f"model.layers.{i}.self_attn.{n}" for i in config.plan.reconstruction_layers
                    for n in ("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias", "k_norm.weight")}
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


def _fuse_experts(state: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Stack per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` into the fused 3-D expert tensors."""
    prefixes = sorted({k.split(".experts.")[0] for k in state if ".mlp.experts.0.gate_proj.weight" in k})
    for prefix in prefixes:
        names = {p: [f"{prefix}.experts.{e}.{p}.weight" for e in range(num_experts)]
                 for p in ("gate_proj", "up_proj", "down_proj")}
        missing = [n for ns in names.values() for n in ns if n not in state]
        if missing:
            raise ValueError(f"{prefix}: expert weights missing for num_experts={num_experts}: {missing[:3]}")
        gate, up, down = ([state.pop(n) for n in names[p]] for p in ("gate_proj", "up_proj", "down_proj"))
        state[f"{prefix}.experts.gate_up_proj"] = torch.stack([torch.cat(gu) for gu in zip(gate, up)])
        state[f"{prefix}.experts.down_proj"] = torch.stack(down)
    return state


def convert_qwen3(src, dst, kv_sharing: str = VANILLA, dtype: torch.dtype | None = None, overwrite: bool = False,
                  **overrides) -> FusedKVForCausalLM:
    """Convert the Qwen3 checkpoint directory `src` into a FusedKV checkpoint at `dst`; returns the model.

    `dst` is written whole or not at all: into a temporary directory beside it, renamed into place at the
    end, so a failed conversion (bad weights, a full disk, Ctrl-C) leaves `dst` as it was. A `dst` that
    already holds files is replaced only with `overwrite=True`."""
    src, dst = Path(src), Path(dst)
    _check_destination(src, dst, overwrite)
    cfg_file = src / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{src} has no config.json; pass a Hugging Face Qwen3 checkpoint directory")
    source_config = json.loads(cfg_file.read_text())
    if source_config.get("model_type") == FusedKVConfig.model_type:  # a fusedkv vanilla model: uptraining
        config = fusedkv_to_plan_config(source_config, kv_sharing, origin=str(src), **overrides)
    else:
        config = qwen3_to_fusedkv_config(source_config, kv_sharing, **overrides)
    model = from_qwen3_state(load_state_dict(src), config, origin=str(src))
    if dtype is not None:
        model = model.to(dtype)

    def write(out: Path) -> None:
        model.save_pretrained(out)
        for name in _TOKENIZER_FILES:
            if (src / name).exists():
                shutil.copy2(src / name, out / name)

    _write_directory_atomically(dst, write)
    return model


def _check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    """Refuse, before any work, a destination that would lose data: a file, the source itself (or a folder
    holding it), or a non-empty directory without `overwrite`."""
    if dst.exists() and not dst.is_dir():
        raise UsageError(f"destination {dst} is a file; give a directory to write the converted model to")
    if src.exists() and (dst.resolve() == src.resolve() or dst.resolve() in src.resolve().parents):
        raise UsageError(f"destination {dst} would replace the source {src}; choose another directory")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise UsageError(f"destination {dst} already holds files; pass --overwrite (overwrite=True) to replace "
                         "them, or choose a new directory")


def _write_directory_atomically(dst: Path, write) -> None:
    """`write(tmp)` fills a temporary directory beside `dst` (same file system), which then replaces `dst`
    by rename; on any failure the temporary directory is removed and `dst` is untouched."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        try:
            write(tmp)
        except Exception as e:
            if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e):
                raise RunError(f"no space left on the device while writing {dst}; nothing was changed there, "
                               "free some disk space and retry") from e
            raise
        if dst.exists():  # swap: the old directory is deleted only once the new one is in place
            old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
            os.rename(dst, old)
            os.rename(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
