"""Multi-node launch: two `torchrun --nnodes=2 --nproc_per_node=1` processes (two "nodes" on this
machine) meeting through c10d rendezvous on 127.0.0.1 train the nano preset under FSDP2, with sharded
checkpoints, and match a single process with the same global batch: per-step losses and final weights."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors.torch import load_file
from train_helpers import REPO, nano_config, subprocess_env

from fusedkv.train import full_checkpoint as ck
from fusedkv.train import train
from fusedkv.train.distributed import free_port

pytestmark = pytest.mark.slow  # the fast tier (-m 'not slow') leaves this module to the full suite

STEPS = 4


def launch_two_nodes(out, data, *extra) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for _ in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=fusedkv-test",
               "--max-restarts=0", "-m", "fusedkv.train.command", "--distributed", "fsdp", "--preset", "nano",
               "--data", str(data), "--out", str(out), "--max-steps", str(STEPS), "--set", "micro_batch_size=2",
               "--set", "threads=1", "--set", "checkpoint_format=sharded", "--quiet", *map(str, extra)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def wait_all(procs, timeout=300) -> None:
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]


def test_two_nodes_match_one_process(tmp_path, nano_data):
    procs = launch_two_nodes(tmp_path / "two-nodes", nano_data)
    single = train(nano_config(tmp_path / "single", nano_data, max_steps=STEPS, micro_batch_size=2))
    wait_all(procs)
    summary = json.loads((tmp_path / "two-nodes" / "summary.json").read_text())
    assert [r["loss"] for r in summary["curve"]] == pytest.approx([r["loss"] for r in single["curve"]], rel=1e-5)
    ref = load_file(str(tmp_path / "single" / "final" / "model.safetensors"))
    got = load_file(str(tmp_path / "two-nodes" / "final" / "model.safetensors"))
    assert got.keys() == ref.keys()
    for name, want in ref.items():
        rel = (got[name] - want).norm() / want.norm().clamp_min(1e-12)
        assert rel < 1e-5, f"{name}: relative difference {rel:.2e}"
    # Each node's rank wrote its own shard of the step-4 checkpoint into the shared run directory.
    files = ck.verify_checkpoint(tmp_path / "two-nodes" / "checkpoints" / ck.step_dir_name(STEPS))["files"]
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "rank-00000.pt", "rank-00001.pt"} <= set(files)
    losses = [r["loss"] for r in summary["curve"]]
    assert losses[-1] < losses[0]  # it trained: not two copies of the initial model
