"""Sharded (DCP) checkpoints: exact round trips across process counts and layouts, async saves that
snapshot the state, a save killed mid-way, and integrity checks.

Saved by 1 process -> loaded by 2 under FSDP2 and under DDP; saved by 2 under FSDP2 -> loaded by 1, and
by 2 under DDP.
Every model and AdamW tensor must come back bit for bit (tests/train/dcp_worker.py). The worker keeps
training while the asynchronous save is written, so a save that did not snapshot would fail too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dcp_worker as W
import pytest
from train_helpers import REPO, subprocess_env

from fusedkv.train import full_checkpoint as ck
from fusedkv.train import sharded_checkpoint as dcp

WORKER = str(Path(__file__).with_name("dcp_worker.py"))


def torchrun(*args, env=None, **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", WORKER, *map(str, args)]
    return subprocess.Popen(cmd, cwd=REPO, env=env or subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, **kw)


@pytest.fixture(scope="module")
def saved(two_ranks):
    root, one, proc = two_ranks  # the torchrun launch shared with test_distributed.py (conftest.py)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return root / "dcp", one, root / "dcp" / "two" / ck.step_dir_name(2)


@pytest.mark.slow
def test_one_process_checkpoint_loads_into_two_ranks(saved):
    # The torchrun launch of the fixture checked FSDP2 and DDP loads of the 1-process checkpoint, and
    # a DDP load of the checkpoint it saved under FSDP2.
    root, one, _ = saved
    manifest = ck.verify_checkpoint(one)
    assert manifest["layout"] == "sharded" and manifest["world_size"] == 1


@pytest.mark.slow
def test_two_rank_fsdp_checkpoint_loads_into_one_process(saved):
    root, _, two = saved
    manifest = ck.verify_checkpoint(two)
    assert manifest["world_size"] == 2
    # Each rank wrote its own shard file and its own RNG/data file.
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "rank-00000.pt", "rank-00001.pt"} <= set(manifest["files"])
    assert W.load("none", two, root / "two.pt") == []


@pytest.mark.slow
def test_read_checkpoint_gives_every_rank_state(saved):
    _, _, two = saved
    got = dcp.read_checkpoint(two)
    assert got["step"] == 2 and got["sharded"] and got["model"] is None
    assert [r["rank"] for r in got["rank_states"]] == [0, 1]


@pytest.mark.slow
def test_corrupt_shard_is_refused(saved, tmp_path):
    import shutil

    _, _, two = saved
    copy = tmp_path / two.name
    shutil.copytree(two, copy)
    shard = copy / "dcp" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="__1_0.distcp does not match its SHA-256"):
        dcp.read_checkpoint(copy)
    shard.unlink()
    with pytest.raises(ValueError, match="__1_0.distcp is missing"):
        ck.verify_checkpoint(copy)


@pytest.mark.slow
def test_wrong_model_is_refused(saved):
    from fusedkv import FusedKVConfig, FusedKVForCausalLM

    _, one, _ = saved
    other = FusedKVForCausalLM(FusedKVConfig(vocab_size=512, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=4, num_attention_heads=4))
    with pytest.raises(ValueError, match="do not fit this model"):
        dcp.load_into(one, other, None)


@pytest.mark.manual
def test_kill_mid_save_leaves_no_checkpoint(tmp_path):
    """SIGKILL both ranks after they wrote their shards but before the manifest: nothing looks complete."""
    root = tmp_path / "ckpts"
    tmp = root / ".tmp-step-00000002-sharded"
    proc = torchrun("hang", "fsdp", root, env=subprocess_env(**{dcp.FINISH_SLEEP_ENV: "120"}))
    pids = []
    try:
        t0 = time.time()
        while not all((tmp / "dcp" / f"__{r}_0.distcp").is_file() for r in (0, 1)) or not (
                tmp / "dcp" / ".metadata").is_file():
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.time() - t0 < 180, "the save never started"
            time.sleep(0.1)
        pids = [int((root / f"pid-{r}").read_text()) for r in (0, 1)]
    finally:
        for pid in pids:  # the ranks themselves (torchrun starts them in sessions of their own)
            os.kill(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert len(pids) == 2
    assert ck.list_checkpoints(root) == [] and ck.latest_checkpoint(root) is None
    assert not (tmp / "manifest.json").exists()
    with pytest.raises(ValueError, match="incomplete"):
        ck.verify_checkpoint(tmp)
    ck.remove_stale_temporaries(root)
    assert not tmp.exists()


def test_paper_presets_save_sharded():
    from fusedkv.train import TrainConfig

    assert TrainConfig(preset="4b", progress=False).checkpoint_format == "sharded"  # FSDP cluster runs
    assert TrainConfig(preset="nano", progress=False).checkpoint_format == "full"
    assert TrainConfig(preset="4b", checkpoint_format="full", progress=False).checkpoint_format == "full"
    with pytest.raises(ValueError, match="checkpoint_format='zip': choose full or sharded"):
        TrainConfig(preset="nano", checkpoint_format="zip", progress=False)
