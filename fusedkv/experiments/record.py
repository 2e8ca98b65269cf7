"""A committed record of a comparison's results, so its tables outlive the machine that trained it.

`runs/` (checkpoints, the run cache) is not committed and a fresh checkout has none of it. A record is a
JSON list with one row per finished (run, seed): its cache key (the hash of its complete training
configuration, `runner.run_experiment`) and what the tables need (loss, curve, scores), not its model.
`fusedkv compare NAME --record FILE` counts a row as a finished run when its key is the key that run
has now; any change to a run's settings gives it another key, so a stale row is never used. A record holds
one row per (run, seed) and per key, with finite numbers for its losses: a file that does not (edited by
hand, merged twice) is refused naming the rows, never read with one row silently winning. A run that
must train from a recorded run (`from:` / `distill:`) needs that run's model, which a record does not
hold: that is an error naming both.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import UsageError

# What a row keeps of a result: everything the tables and verdicts read, nothing that names a local file.
FIELDS = ("name", "seed", "key", "plan", "cache", "val_loss", "val_ppl", "curve", "tokens_seen", "tokens_offset",
          "init_val_loss", "task_limit", "tasks", "retrieval")
REQUIRED = ("name", "seed", "key", "val_loss")
NUMBERS = ("val_loss", "val_ppl", "init_val_loss")  # finite when present (val_loss always is)


def rows(results: list[dict]) -> list[dict]:
    """The record's rows for finished results (as `run_experiment` returns them)."""
    return [{k: r[k] for k in FIELDS if k in r} for r in results]


def merged(old: list[dict], new: list[dict]) -> list[dict]:
    """`old` with every (run, seed) of `new` replacing its row there, sorted by run and seed: refreshing a
    record from a machine that trained only some runs keeps the others."""
    by_run = {(r["name"], r["seed"]): r for r in old} | {(r["name"], r["seed"]): r for r in new}
    return [by_run[k] for k in sorted(by_run)]


def load(path) -> dict[str, dict]:
    """A record file's rows by cache key; a UsageError saying what is wrong with a file that is not one."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--record {path}: no such file (a record is written by scripts/evidence_claims.py)")
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"--record {path} is not a JSON file: {e}") from None
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise UsageError(f"--record {path}: a record is a JSON list of result rows, one per (run, seed)")
    first: dict = {}  # (run, seed) or key -> the row that has it
    for i, row in enumerate(data):
        missing = [k for k in REQUIRED if k not in row]
        if missing:
            raise UsageError(f"--record {path}: row {i} has no {', '.join(missing)}; every row needs "
                             f"{', '.join(REQUIRED)}")
        what = f"row {i} (run {row['name']!r} seed {row['seed']!r})"
        if not isinstance(row["seed"], int) or isinstance(row["seed"], bool):
            raise UsageError(f"--record {path}: {what}: seed {row['seed']!r} is not an integer")
        for k in NUMBERS:
            v = row.get(k)
            if (v is not None or k == "val_loss") and not _finite(v):
                raise UsageError(f"--record {path}: {what}: {k} {v!r} is not a finite number; fix or remove the row")
        for ident, named in (((row["name"], row["seed"]), f"run {row['name']!r} seed {row['seed']}"),
                             (("key", row["key"]), f"key {row['key']}")):
            if ident in first:
                raise UsageError(f"--record {path}: rows {first[ident]} and {i} are both {named}; a record holds one "
                                 "row per run and seed: remove the stale one")
            first[ident] = i
    return {row["key"]: row for row in data}


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
