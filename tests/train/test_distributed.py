"""Two-process DDP and FSDP2 runs (torchrun, gloo, CPU) reach the parameters of a one-process run
with the same global batch: each rank takes its rows of the global batch, so 2 ranks x 2 accumulated
micro-batches is the same optimisation as 1 rank x 4. One torchrun launch runs both
modes (tests/train/dist_worker.py) to keep the suite fast."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import REPO, nano_config, subprocess_env

from fusedkv.train import train

pytestmark = pytest.mark.slow  # the fast tier (-m 'not slow') leaves this module to the full suite

STEPS = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory, nano_data):
    root = tmp_path_factory.mktemp("dist")
    single = train(nano_config(root / "single", nano_data, max_steps=STEPS, micro_batch_size=2))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(Path(__file__).with_name("dist_worker.py")),
        str(nano_data),
        str(root),
        str(STEPS),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return root, single


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
