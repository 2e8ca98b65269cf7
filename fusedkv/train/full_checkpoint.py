"""Training checkpoints that lose nothing, written atomically, verified before use; stop signals.

A checkpoint is a directory `out_dir/checkpoints/step-NNNNNNNN/` holding

    model.safetensors     full (unsharded) model state dict; a tensor held under two names (a tied head:
                          lm_head.weight is model.embed_tokens.weight) is stored once, the other name
                          recorded in the file's metadata (`ALIASES`) and restored as the same tensor on load
    optimizer.pt          full AdamW state, keyed by parameter name (portable across none/DDP/FSDP)
    trainer_state.pt      step, tokens seen, LR-scheduler state, data-loader state, every rank's RNG
                          states (python, numpy, torch CPU, CUDA), the learning curve so far
    train_config.json     the resolved TrainConfig
    model_config.json     the FusedKVConfig
    manifest.json         written last: step, and size + SHA-256 of every file above (the same
                          manifest as a trained model's final/, fusedkv/model_dirs.py)

Atomicity: everything is written into a hidden temporary directory next to the others, fsynced,
and only then renamed to its final name (a rename within one filesystem is atomic). A crash or
SIGKILL at any moment leaves either the new complete checkpoint or none, and the previous ones
are pruned only after the new one exists, so the last good checkpoint is always on disk.

Verification: `verify_checkpoint` checks the manifest and each file's size and hash, so a truncated
or bit-rotted checkpoint is refused with a message naming the bad file instead of loading garbage.

Signals: `StopSignals` turns the first SIGINT/SIGTERM into a flag that the training loop reads
after finishing the current step, so it can save a checkpoint and exit cleanly; a second signal
aborts at once (the last complete checkpoint is still intact).
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import signal
import threading
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ..errors import RunError
from ..model_dirs import MANIFEST_FORMAT, sha256_file, verify_manifest, write_manifest
from ..utils import replace_dir

FORMAT_VERSION = MANIFEST_FORMAT  # names train/sharded_checkpoint.py uses
_sha256 = sha256_file

_STEP_DIR = re.compile(r"^step-(\d{8})$")
# safetensors metadata key: {"alias name": "stored name"} for tensors saved once under their first name.
ALIASES = "fusedkv_aliases"
_FILES = ("model.safetensors", "optimizer.pt", "trainer_state.pt", "train_config.json", "model_config.json")


def checkpoint_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Finished checkpoint directories (they have a manifest), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(root: str | Path) -> Path | None:
    ckpts = list_checkpoints(root)
    return ckpts[-1] if ckpts else None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(
    root: str | Path,
    step: int,
    model_state: dict,
    optim_state: dict,
    trainer_state: dict,
    train_config: dict,
    model_config: dict,
    keep: int = 2,
) -> Path:
    """Write a complete checkpoint for `step` atomically and prune older ones (rank 0 only)."""
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    current = tmp  # the file being written, for the message if the disk is full
    try:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        current = tmp / "model.safetensors"
        tensors, aliases = _unshared(model_state)
        save_file(tensors, str(current), metadata={"format": "pt", ALIASES: json.dumps(aliases, sort_keys=True)})
        current = tmp / "optimizer.pt"
        torch.save(optim_state, current)
        current = tmp / "trainer_state.pt"
        torch.save(trainer_state, current)
        current = tmp / "train_config.json"
        current.write_text(json.dumps(train_config, indent=2, sort_keys=True) + "\n")
        current = tmp / "model_config.json"
        current.write_text(json.dumps(model_config, indent=2, sort_keys=True) + "\n")
        current = tmp / "manifest.json"
        write_manifest(tmp, _FILES, step=step)  # last: its presence marks the files complete
        _fsync_dir(tmp)
        current = final
        replace_dir(tmp, final)  # also when the same step is saved again (signalled right after a resume)
        _fsync_dir(root)
    except Exception as e:
        reason = write_failure(e, current)
        if reason is None:
            raise
        last = latest_checkpoint(root)
        raise RunError(
            f"could not write {current} ({reason}): the checkpoint of step {step} was not saved and its "
            f"temporary directory was removed; the last good checkpoint is {last or '(none)'}. Free some space "
            f"and continue with `fusedkv train --resume {root.parent}`"
        ) from e
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    for old in list_checkpoints(root)[:-keep]:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _unshared(state: dict) -> tuple[dict, dict]:
    """(tensors, aliases) for safetensors, which refuses two names on one memory: a tensor that is another
    name's very tensor (a tied head) is stored once and listed in `aliases`; any other overlap (views of
    one buffer) is copied, so each name keeps its own values."""
    tensors, aliases, seen, storages = {}, {}, {}, set()
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        ptr = t.untyped_storage().data_ptr()
        t = t.contiguous()
        tensors[name] = t.clone() if t.numel() and ptr in storages else t
        storages.add(ptr)
    return tensors, aliases


def _load_model_state(file: Path, map_location) -> dict:
    """The saved model state dict, every alias restored as the same tensor as the name it was stored under."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        aliases = json.loads((f.metadata() or {}).get(ALIASES, "{}"))
    state = load_file(str(file), device=str(map_location))
    for name, stored in aliases.items():
        state[name] = state[stored]
    return state


def write_failure(e: BaseException, path: str | Path | None = None) -> str | None:
    """Why a write failed, if `e` is a failed write (OSError; safetensors' and torch.save's own errors
    for a full disk); None for anything else. `path`: the file, to look at the free space left."""
    if isinstance(e, OSError):
        return "no space left on the device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
    text = str(e)
    if "No space left" in text:
        return "no space left on the device"
    if type(e).__name__ == "SafetensorError" and "I/O error" in text:
        return text
    if isinstance(e, RuntimeError) and ("inline_container" in text or "PytorchStreamWriter" in text):
        # torch.save's zip writer does not say why; a (nearly) full disk is by far the likeliest.
        try:
            full = path is not None and shutil.disk_usage(Path(path).parent).free < (1 << 20)
        except OSError:
            full = False
        return "no space left on the device" if full else "the file could not be written in full; is the disk full?"
    return None


def remove_stale_temporaries(root: str | Path) -> None:
    """Delete temporary directories left by a killed save (they were never valid checkpoints)."""
    root = Path(root)
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith((".tmp-", ".old-")):
                shutil.rmtree(p, ignore_errors=True)


def verify_checkpoint(path: str | Path) -> dict:
    """Return the manifest of a complete, intact checkpoint; ValueError saying what is wrong otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} does not exist (or is not a directory)")
    manifest = verify_manifest(path, what=f"checkpoint {path}")
    if manifest is None:
        raise ValueError(f"checkpoint {path} is incomplete: it has no manifest.json (the save did not finish)")
    if "step" not in manifest:
        raise ValueError(f"checkpoint {path} is corrupt: its manifest.json has no step")
    return manifest


def load_checkpoint(path: str | Path, map_location="cpu") -> dict:
    """Verify and load a checkpoint: model/optimizer/trainer state and both configs."""
    path = Path(path)
    manifest = verify_checkpoint(path)
    try:
        return {
            "path": path,
            "step": int(manifest["step"]),
            "model": _load_model_state(path / "model.safetensors", map_location),
            "optimizer": torch.load(path / "optimizer.pt", map_location=map_location, weights_only=True),
            "trainer_state": torch.load(
                path / "trainer_state.pt", map_location=map_location, weights_only=True
            ),
            "train_config": json.loads((path / "train_config.json").read_text()),
            "model_config": json.loads((path / "model_config.json").read_text()),
        }
    except Exception as e:  # a file that hashes right but does not parse: written by something else
        raise ValueError(f"checkpoint {path} could not be read ({type(e).__name__}: {e})") from e


def read_train_config(path: str | Path) -> dict:
    """The TrainConfig dict stored in a checkpoint (for `--resume` without repeating the flags)."""
    verify_checkpoint(path)
    return json.loads((Path(path) / "train_config.json").read_text())


# ---- RNG state -------------------------------------------------------------------------------------
def capture_rng() -> dict:
    """Every RNG a training step could touch. numpy's state is stored as tensors so the checkpoint
    loads with torch.load(weights_only=True)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    v = state["python"]
    random.setstate((v[0], tuple(v[1]), v[2]))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- stop signals ----------------------------------------------------------------------------------
class StopSignals:
    """Context manager: the first SIGINT/SIGTERM sets `.received` (the loop saves and stops after
    the current step); a second one raises KeyboardInterrupt at once. Handlers are restored on exit,
    so `train()` can be called repeatedly in one process. Outside the main thread (where Python
    cannot install handlers) it does nothing."""

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self):
        self.received: str | None = None
        self._old: dict = {}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.received is not None:
            raise KeyboardInterrupt(f"second {name}: stopping without saving")
        self.received = name

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name)
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
