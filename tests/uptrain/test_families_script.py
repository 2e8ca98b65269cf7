"""scripts/uptrain_families.py (the per-family results of docs/results.md) at a toy budget: one family, one
seed; it writes the table with the control, and a second run reuses every cached stage."""

import json
import os
from pathlib import Path

import pytest

from tests import _cli as cli_process

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_families_script_runs_and_reuses_its_cache(tmp_path):
    from fusedkv.data import read_builtin_text

    # test_uptrain.py's environment (the script sets the last two itself): one forking process serves both files.
    env = {**{k: v for k, v in os.environ.items() if k != "FUSEDKV_DEBUG"},
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}
    script = REPO / "scripts" / "uptrain_families.py"
    corpus = tmp_path / "corpus.txt"  # a slice of the built-in corpus: its 10 MB take long to tokenise
    corpus.write_text(read_builtin_text(limit_chars=150_000))
    args = [tmp_path / "out", "--families", "deepseek_v3", "--seeds", "0", "--teacher-steps", "3", "--steps", "2",
            "--data", corpus]
    # `python SCRIPT ARGS`, forked from a process that imported fusedkv once (tests/_cli.py)
    first = cli_process.run_script(script, *args, cwd=REPO, env=env, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    rows = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [(r["family"], r["plan"], r["seed"]) for r in rows] == [("deepseek_v3", "fusedkv", 0)]
    row = rows[0]
    assert row["cache_student"] * 5 == row["cache_teacher"] * 3  # 5 layers: the lower 3 keep their cache
    assert abs(row["control_start"] - row["teacher"]) < 1e-4  # the control starts as the teacher
    assert "--plan fusedkv --seed 0" in row["command"]
    assert "mean ± sd (1)" in (tmp_path / "out" / "results.md").read_text()
    again = cli_process.run_script(script, *args, cwd=REPO, env=env, timeout=900)
    assert again.returncode == 0 and "pre-training" not in again.stdout
    assert json.loads((tmp_path / "out" / "results.json").read_text()) == rows
