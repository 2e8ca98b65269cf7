"""The run directory (`out_dir`): one run owns it at a time, and a new run replaces an old one only
once it is known to start.

* `RunDirLock`: an exclusive OS file lock (`fcntl.flock`) on `out_dir/.lock`, held for the whole run.
  The kernel drops it when the process ends, however it ends, so a killed run never leaves a stale
  lock. The holder writes who it is (pid, host, start time, command) into the lock file, and a
  second run into the same directory (a fresh run, `--overwrite` or `--resume`) is refused at once
  with those details. The lock is re-entrant within one process (the CLI takes it before reading a
  checkpoint to resume, `train()` takes it again).
* `clear_previous_run`: what `--overwrite` deletes, called only after the new run has validated its
  config and built its model.
* `find_resume_checkpoint`: the one place that decides which checkpoint `--resume` continues from.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import shlex
import shutil
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UsageError
from . import full_checkpoint as ckpt_io

LOCK_NAME = ".lock"
# Everything a run writes into out_dir (besides the lock); --overwrite removes exactly these.
RUN_OUTPUTS = ("checkpoints", "final", "tb", "metrics.csv", "summary.json", "learning_curves.png", "init_eval.json")

# Locks this process holds: resolved out_dir -> [open lock file, re-entry count].
_HELD: dict[str, list] = {}


class RunDirBusy(UsageError):
    """Another process is running in this out_dir."""


class RunDirLock:
    """Context manager: hold the exclusive lock on `out_dir` (created if missing).

    If the directory did not exist and nothing but the lock was written into it when the lock is
    released, the directory is removed again: a run that failed on bad input leaves no trace.
    """

    def __init__(self, out_dir: str | Path):
        self.out = Path(out_dir)
        self.key = str(self.out.resolve())
        self._created: Path | None = None  # the topmost directory this lock created

    def __enter__(self) -> RunDirLock:
        held = _HELD.get(self.key)
        if held is not None:
            held[1] += 1
            return self
        missing = [p for p in (self.out, *self.out.parents) if not p.exists()]
        self._created = missing[-1] if missing else None
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / LOCK_NAME
        while True:
            f = open(path, "a+")  # noqa: SIM115 (held open for the whole run)
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "another process (it has not written its details yet)"
                f.close()
                raise RunDirBusy(
                    f"out_dir {self.out} is in use by {holder}; wait for that run to finish (or stop it), "
                    "or choose another --out"
                ) from None
            # The previous holder may have removed the lock file between our open() and flock():
            # then we locked a deleted file, and must lock the one that is there now.
            try:
                same = os.path.samestat(os.fstat(f.fileno()), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                break
            f.close()
        f.seek(0)
        f.truncate()
        f.write(_holder_description() + "\n")
        f.flush()
        _HELD[self.key] = [f, 1]
        return self

    def __exit__(self, *exc) -> None:
        held = _HELD[self.key]
        held[1] -= 1
        if held[1]:
            return
        del _HELD[self.key]
        f = held[0]
        if self._created is not None and {p.name for p in self.out.iterdir()} <= {LOCK_NAME}:
            # Unlink before unlocking: a process waiting on this file re-checks it and starts over.
            (self.out / LOCK_NAME).unlink(missing_ok=True)
            f.close()
            d = self.out
            try:
                while True:  # the directories this run created, up to the first one that existed
                    d.rmdir()
                    if d == self._created:
                        break
                    d = d.parent
            except OSError:  # someone else wrote there meanwhile: leave it
                pass
            return
        f.seek(0)
        f.truncate()  # the details describe a running process only
        f.close()


def _holder_description() -> str:
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    argv = list(getattr(sys, "orig_argv", None) or sys.argv)  # orig_argv keeps `python -m module`
    cmd = shlex.join([Path(argv[0]).name, *argv[1:]]) if argv else "python"
    return f"pid {os.getpid()} on host {socket.gethostname()}, started {started} ({cmd})"


def holds_run(out_dir: str | Path) -> bool:
    return str(Path(out_dir).resolve()) in _HELD


def clear_previous_run(out_dir: str | Path, names: tuple[str, ...] = RUN_OUTPUTS) -> list[str]:
    """Delete the outputs (`names`) of the run that `--overwrite` replaces; returns the names removed. The
    caller has checked everything the new run needs first (`fusedkv train`, `fusedkv uptrain`)."""
    out = Path(out_dir)
    removed = []
    for name in names:
        p = out / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
        else:
            continue
        removed.append(name)
    for p in out.glob(".final.*"):  # temporaries of a killed final save
        shutil.rmtree(p, ignore_errors=True)
    return removed


# ---- the checkpoint to resume: decided here, for the CLI and for train() ------------------------------
@dataclass
class ResumePoint:
    checkpoint: Path  # verified
    run_dir: Path  # where the run continues (the checkpoint's run unless --out says otherwise)
    warnings: list[str] = field(default_factory=list)  # newer checkpoints skipped as corrupt


def find_resume_checkpoint(target: str | Path) -> ResumePoint:
    """`target` is a run directory (its newest checkpoint that verifies; a corrupt newer one is skipped
    with a warning) or one checkpoint directory (used as it is, if it verifies). ValueError otherwise."""
    target = Path(target)
    if not target.exists():
        raise ValueError(f"--resume {target}: no such run or checkpoint directory")
    root = ckpt_io.checkpoint_root(target)
    if root.is_dir():
        found = ckpt_io.list_checkpoints(root)
        if not found:
            raise ValueError(f"nothing to resume: {root} holds no checkpoint; run without --resume to start")
        warnings, errors = [], []
        for ckpt in reversed(found):
            try:
                ckpt_io.verify_checkpoint(ckpt)
            except ValueError as e:
                errors.append(str(e))
                continue
            if errors:
                warnings.append(f"{'; '.join(errors)}: resuming from the newest intact one, {ckpt.name}")
            return ResumePoint(ckpt, target, warnings)
        raise ValueError(f"no checkpoint in {root} verifies ({'; '.join(errors)}); start over with --overwrite")
    if (target / "manifest.json").is_file() or (target / "train_config.json").is_file():
        ckpt_io.verify_checkpoint(target)
        return ResumePoint(target, target.parent.parent)
    raise ValueError(
        f"--resume {target}: not a run directory (it has no checkpoints/) nor a checkpoint directory "
        "(no manifest.json); pass the --out directory of the run to continue"
    )
