"""Training with sharded (DCP) checkpoints: resume on another number of processes and another layout
(2 FSDP2 ranks -> 1 process; 1 process -> 2 DDP ranks), after a SIGKILL that lands in the middle of a
save, and check that the loss curve continues exactly as an uninterrupted run's (same global batch,
same data order: every rank takes its rows of the global batch, `fusedkv.data.TokenBatches`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_helpers import REPO, nano_config, subprocess_env, train_cli

from fusedkv.train import full_checkpoint as ck
from fusedkv.train import sharded_checkpoint as dcp
from fusedkv.train import train

pytestmark = pytest.mark.slow  # the fast tier (-m 'not slow') leaves this module to the full suite

STEPS = 6


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (torchrun starts its workers in sessions of their own)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def torchrun_train(out, data, mode: str, *extra, env=None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "fusedkv.train.command", "--distributed", mode, "--preset", "nano", "--data", str(data), "--out", str(out),
           "--max-steps", str(STEPS), "--set", "micro_batch_size=2", "--set", "ckpt_every=2", "--set", "threads=1",
           "--set", "checkpoint_format=sharded", "--quiet", *map(str, extra)]
    return subprocess.Popen(cmd, cwd=REPO, env=env or subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, nano_data):
    """The uninterrupted run: one process, full checkpoints."""
    return train(nano_config(tmp_path_factory.mktemp("ref") / "run", nano_data, max_steps=STEPS,
                             micro_batch_size=2, ckpt_every=2))


def losses(result: dict) -> list[float]:
    return [r["loss"] for r in result["curve"]]


def test_fsdp_two_ranks_killed_mid_save_resume_on_one_process(tmp_path, nano_data, reference):
    out = tmp_path / "run"
    root = out / "checkpoints"
    pending = root / ".tmp-step-00000004-sharded"
    # Each background save waits 2 s before its manifest: step 2's completes, step 4's is killed inside it.
    proc = torchrun_train(out, nano_data, "fsdp", env=subprocess_env(**{dcp.FINISH_SLEEP_ENV: "2"}))
    try:
        t0 = time.time()
        while not ((root / "step-00000002").is_dir() and (pending / "dcp" / ".metadata").is_file()):
            assert proc.poll() is None, proc.communicate()[0][-4000:]
            assert time.time() - t0 < 240, "the step-4 save never started"
            time.sleep(0.02)
        workers = children(proc.pid)
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    assert len(workers) == 2
    assert [p.name for p in ck.list_checkpoints(root)] == ["step-00000002"]  # step 4 never looked complete
    assert ck.verify_checkpoint(root / "step-00000002")["world_size"] == 2
    assert not (pending / "manifest.json").exists()

    res = train(nano_config(out, nano_data, max_steps=STEPS, micro_batch_size=2, ckpt_every=2, resume=True,
                            checkpoint_format="sharded"))
    assert not pending.exists()  # the killed save's temporary was cleared
    assert losses(res) == pytest.approx(losses(reference), rel=1e-5, abs=1e-6)
    assert res["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)
    assert (out / "final" / "model.safetensors").is_file()  # final/ is still a plain HF model
    assert dcp.is_sharded(ck.latest_checkpoint(root))


def test_one_process_resumes_on_two_ddp_ranks(tmp_path, nano_data, reference):
    out = tmp_path / "run"
    proc = train_cli("--preset", "nano", "--data", nano_data, "--out", out, "--max-steps", STEPS,
                     "--set", "micro_batch_size=2", "--set", "ckpt_every=2", "--set", "threads=1",
                     "--set", "checkpoint_format=sharded", "--quiet",
                     env=subprocess_env(FUSEDKV_TRAIN_STEP_SLEEP="0.5"))
    try:
        t0 = time.time()
        while not (out / "checkpoints" / "step-00000002").is_dir():
            assert proc.poll() is None, proc.communicate()[1][-4000:]
            assert time.time() - t0 < 120, "no step-2 checkpoint"
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    saved = ck.latest_checkpoint(out / "checkpoints")
    assert ck.verify_checkpoint(saved)["world_size"] == 1
    resumed_from = int(saved.name.split("-")[1])

    proc = torchrun_train(out, nano_data, "ddp", "--resume")
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["curve"]) == STEPS and resumed_from < STEPS
    assert losses(summary) == pytest.approx(losses(reference), rel=1e-5, abs=1e-6)
    assert ck.verify_checkpoint(ck.latest_checkpoint(out / "checkpoints"))["world_size"] == 2
