"""Checkpoint files: atomic save, verification of truncated/corrupted files, pruning, RNG states."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from fusedkv.train import full_checkpoint as ck


def _save(root, step, keep=2, value=1.0):
    sd = {"w": torch.full((3, 4), value), "b": torch.arange(5.0)}
    return ck.save_checkpoint(
        root,
        step,
        sd,
        {"state": {}, "param_groups": []},
        {"step": step, "rng": [ck.capture_rng()]},
        {"seed": 0},
        {"model_type": "fusedkv"},
        keep=keep,
    )


def test_round_trip_and_pruning(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        _save(root, step, value=float(step))
    assert [p.name for p in ck.list_checkpoints(root)] == ["step-00000004", "step-00000006"]
    assert ck.latest_checkpoint(root).name == "step-00000006"
    loaded = ck.load_checkpoint(ck.latest_checkpoint(root))
    assert loaded["step"] == 6 and torch.equal(loaded["model"]["w"], torch.full((3, 4), 6.0))
    assert loaded["trainer_state"]["step"] == 6 and loaded["train_config"] == {"seed": 0}
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_interrupted_save_is_invisible(tmp_path):
    """A save killed half-way leaves only a hidden temporary directory: never listed, then cleaned."""
    root = tmp_path / "checkpoints"
    good = _save(root, 2)
    tmp = root / ".tmp-step-00000004-999"
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"partial")
    assert ck.latest_checkpoint(root) == good
    ck.remove_stale_temporaries(root)
    assert not tmp.exists() and good.exists()


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete_manifest", "delete_file"])
def test_corruption_is_detected(tmp_path, damage):
    path = _save(tmp_path / "checkpoints", 2)
    target = path / "model.safetensors"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:50])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[-1] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "delete_manifest":
        (path / "manifest.json").unlink()
    else:
        (path / "optimizer.pt").unlink()
    with pytest.raises(ValueError, match="corrupt|incomplete"):
        ck.load_checkpoint(path)


def test_rng_round_trip():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = ck.capture_rng()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    ck.restore_rng(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_stop_signals_restore_handlers():
    import signal

    before = signal.getsignal(signal.SIGINT)
    with ck.StopSignals() as s:
        signal.raise_signal(signal.SIGINT)
        assert s.received == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)  # the second one aborts at once
    assert signal.getsignal(signal.SIGINT) is before
