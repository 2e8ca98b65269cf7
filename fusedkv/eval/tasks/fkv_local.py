"""Dataset loader for the local lm-eval tasks in this folder (referenced as ``!function fkv_local.load``).

lm-eval hands ``dataset_kwargs`` to ``datasets.load_dataset`` unchanged, so a relative ``data_files``
path would be resolved against the current working directory, not against the YAML file. The task
YAMLs here use ``custom_dataset`` instead: lm-eval imports this file from the YAML's own folder and
calls :func:`load`, which reads the jsonl next to it, so the tasks work from any working directory and
from an installed wheel. (:func:`fusedkv.eval.harness.materialize_local_tasks` writes plain
``dataset_path: json`` copies with absolute paths for tools that cannot run this loader.)
"""

from __future__ import annotations

import json
from pathlib import Path


def load(data_file: str, split: str = "test", **_ignored):
    """``{split: Dataset}`` from ``data_file`` (relative to this folder). Extra kwargs are lm-eval metadata."""
    import datasets

    path = Path(data_file)
    if not path.is_absolute():
        path = Path(__file__).resolve().parent / path
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {split: datasets.Dataset.from_list(rows)}
