"""Helpers shared by the training tests (a module of its own: conftest files are not importable)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from fusedkv.train import TrainConfig
from tests import _cli as cli_process

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


def train_cli(*args, env: dict | None = None):
    """Start `python -m fusedkv.train.command ARGS` (the `fusedkv train` handler) in a child process, left
    running: forked from a process that imported fusedkv once (tests/_cli.py), with Popen's poll, wait,
    communicate, send_signal, pid and returncode."""
    return cli_process.start_module("fusedkv.train.command", *args, env=env, cwd=REPO)


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
