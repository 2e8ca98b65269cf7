"""Checks that turn a bad checkpoint directory into a clear message before transformers reads it.

transformers would warn and carry on when a `qwen3` config is loaded into a FusedKV model, and fail
deep inside safetensors on a truncated file. Users get told what is wrong and how to fix it instead.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def check_checkpoint_dir(path, config=None) -> None:
    """Validate a local checkpoint directory (hub names pass through untouched)."""
    p = Path(str(path))
    if not p.exists():
        if os.sep in str(path) or str(path).startswith("."):
            raise ValueError(f"checkpoint directory {str(path)!r} does not exist")
        return  # a hub repo id: let transformers resolve it
    if not p.is_dir():
        raise ValueError(f"{str(path)!r} is a file; pass the checkpoint directory (the one with config.json)")
    if config is None:
        cfg_file = p / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"{p} has no config.json; it is not a saved model directory (save with save_pretrained)")
        try:
            model_type = json.loads(cfg_file.read_text()).get("model_type")
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_file} is not valid JSON ({e}); the checkpoint is corrupt") from e
        if model_type != "fusedkv":
            hint = f"; import it with `fusedkv convert {p} OUT_DIR --kv-sharing PLAN`" if model_type == "qwen3" else ""
            raise ValueError(f"{p} holds a {model_type!r} model, not a 'fusedkv' model{hint}")
    weights = sorted(p.glob("*.safetensors"))
    if not weights and not (p / "pytorch_model.bin").exists():
        raise ValueError(f"{p} has no weights (*.safetensors); the save did not finish or the files were removed")
    for w in weights:
        _check_safetensors(w)


def _check_safetensors(file: Path) -> None:
    """A safetensors file starts with an 8-byte header length, then a JSON header whose offsets must
    fit in the file: checking that catches truncation without reading the tensors."""
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{file} is truncated ({size} bytes); re-save or re-download the checkpoint")
        n = int.from_bytes(head, "little")
        if n <= 0 or 8 + n > size:
            raise ValueError(f"{file} is corrupt: its header does not fit in the file; re-save the checkpoint")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{file} is corrupt: unreadable header ({e})") from e
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        raise ValueError(
            f"{file} is truncated or corrupt: its header describes {8 + n + end} bytes but the file has {size}; "
            "re-save the checkpoint"
        )
