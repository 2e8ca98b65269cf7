"""Helpers shared by the training tests (a module of its own: conftest files are not importable)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from fusedkv.train import TrainConfig

REPO = Path(__file__).resolve().parents[2]


def nano_config(out_dir, data, **overrides) -> TrainConfig:
    base = dict(preset="nano", data=str(data), out_dir=str(out_dir), progress=False, threads=1)
    base.update(overrides)
    return TrainConfig(**base)


def subprocess_env(**extra) -> dict:
    """The repo on PYTHONPATH (whatever the editable install points at) and one thread per process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **extra)
    return env


def train_cli(*args, **popen_kwargs) -> subprocess.Popen:
    """Start `python -m fusedkv.train.command ARGS` (the `fusedkv train` handler) in a subprocess."""
    return subprocess.Popen(
        [sys.executable, "-m", "fusedkv.train.command", *map(str, args)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen_kwargs,
    )


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 120.0, what: str = "condition"):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if predicate():
            return
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"process ended (rc {proc.returncode}) before {what}:\n{out}\n{err}")
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"timed out waiting for {what}")
