"""Two-process DDP and FSDP2 runs (torchrun, gloo, CPU) reach the parameters of a one-process run
with the same global batch: each rank takes its rows of the global batch, so 2 ranks x 2 accumulated
micro-batches is the same optimisation as 1 rank x 4. One torchrun launch runs both
modes (tests/train/dist_worker.py, test_dcp.py's checks too) to keep the suite fast."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import nano_config

from fusedkv.train import train

pytestmark = pytest.mark.slow  # the fast tier (-m 'not slow') leaves this module to the full suite

STEPS = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory, nano_data, two_ranks):
    root, _, proc = two_ranks  # the torchrun launch shared with test_dcp.py (conftest.py)
    assert (root / "dist" / "fsdp" / "losses.json").is_file(), proc.stdout[-3000:] + proc.stderr[-5000:]
    single = train(nano_config(root / "dist" / "single", nano_data, max_steps=STEPS, micro_batch_size=2))
    return root / "dist", single


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_match_one(runs, mode):
    root, single = runs
    ref = load_file(str(root / "single" / "final" / "model.safetensors"))
    got = load_file(str(root / mode / "final" / "model.safetensors"))
    assert got.keys() == ref.keys()
    for name, want in ref.items():
        rel = (got[name] - want).norm() / want.norm().clamp_min(1e-12)
        assert rel < 1e-5, f"{mode} {name}: relative difference {rel:.2e}"
    losses = json.loads((root / mode / "losses.json").read_text())
    assert losses == pytest.approx([r["loss"] for r in single["curve"]], rel=1e-5)
    assert losses[-1] < losses[0]  # the parameters did move: not two identical initial models
    # The training checkpoint holds full tensors gathered on rank 0 (resumable in any layout).
    ckpt = load_file(str(root / mode / "checkpoints" / f"step-{STEPS:08d}" / "model.safetensors"))
    assert all(torch.equal(ckpt[k], got[k]) for k in got)
