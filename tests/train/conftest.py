"""Fixtures for the training tests: a small prepared dataset (once per session) and nano configs.

Everything runs single-threaded: on a 2-core machine shared with other jobs, OpenMP threads that
spin against each other make torch several times slower (and timing-dependent)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusedkv.data import prepare_dataset, read_builtin_text


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True, scope="session")
def _data_cache(tmp_path_factory):
    """Runs that prepare data by default write to $FUSEDKV_DATA_DIR: keep that out of the repo."""
    mp = pytest.MonkeyPatch()
    mp.setenv("FUSEDKV_DATA_DIR", str(tmp_path_factory.mktemp("data-cache")))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory) -> Path:
    """~200 KB of the built-in text as one file (a single document: the val split is its tail)."""
    p = tmp_path_factory.mktemp("corpus") / "small.txt"
    p.write_text(read_builtin_text(limit_chars=200_000))
    return p


@pytest.fixture(scope="session")
def nano_data(tmp_path_factory, corpus_file) -> Path:
    """A prepared dataset (512-token BPE) that every nano run shares."""
    out = tmp_path_factory.mktemp("data") / "nano-512"
    prepare_dataset(str(corpus_file), out, vocab_size=512, num_proc=1)
    return out


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory, nano_data):
    """One `torchrun --nproc_per_node=2` launch (gloo, CPU) for test_distributed.py and test_dcp.py
    (dist_worker.py): DDP and FSDP2 runs of the nano preset, 3 steps, into ROOT/dist/{ddp,fsdp}, then the
    sharded-checkpoint suite on the 1-process checkpoint saved here (ROOT/dcp/one). Returns (ROOT, one's
    checkpoint, the finished launch)."""
    import dcp_worker
    from train_helpers import REPO, subprocess_env

    root = tmp_path_factory.mktemp("two-ranks")
    dcp = root / "dcp"
    one = dcp_worker.save("none", dcp / "one", dcp / "one.pt")  # in this process, no process group
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(__file__).with_name("dist_worker.py")), nano_data, root / "dist", 3,
           one, dcp / "one.pt", dcp / "two", dcp / "two.pt"]
    proc = subprocess.run(list(map(str, cmd)), cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=480)
    return root, one, proc
