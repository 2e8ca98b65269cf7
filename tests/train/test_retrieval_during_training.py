"""scripts/retrieval_during_training.py: scores a run's checkpoints and its final model, once each."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from fusedkv.cli import main

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "retrieval_during_training.py"


def _script():
    spec = importlib.util.spec_from_file_location("retrieval_during_training", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_every_checkpoint_and_the_final_model_are_scored_once(tmp_path, nano_data):
    run = tmp_path / "run"
    main(["train", "--preset", "nano", "--plan", "fusedkv", "--out", str(run), "--max-steps", "4",
          "--set", f"data={nano_data}", "--set", "threads=1", "--set", "ckpt_every=2", "--set", "eval_every=0"])
    script = _script()
    out, png = tmp_path / "steps.jsonl", tmp_path / "steps.png"
    argv = ["--runs", f"nano={run}",
            "--tokenizer", str(Path(nano_data) / "tokenizer"), "--out", str(out), "--lengths", "48",
            "--pairs", "2", "--samples", "2", "--plot", str(png)]
    old, sys.argv = sys.argv, ["retrieval_during_training.py", *argv]
    try:
        script.main()
        script.main()  # a re-run scores nothing twice
    finally:
        sys.argv = old
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["step"] for r in rows) == [2, 4]  # step 4's checkpoint and final/ are the same step
    assert all(set(r["mqar"]) == {"2"} and 0.0 <= r["mqar"]["2"]["48"] <= 100.0 for r in rows)
    assert png.stat().st_size > 0
    # The training checkpoint and the saved final model load to the same weights.
    step4 = script.load_step(run / "checkpoints" / "step-00000004")
    final = script.load_step(run / "final")
    assert all((a == b).all() for a, b in zip(step4.state_dict().values(), final.state_dict().values()))


def test_emergence_is_the_first_step_whose_mean_over_pairs_reaches_the_threshold(tmp_path):
    def row(run, step, a2, a4, long=0.0):  # the 128-token cells must not count: the shortest length does
        return {"run": run, "step": step, "mqar": {"2": {"64": a2, "128": long}, "4": {"64": a4, "128": long}}}

    rows = [row("slow", 250, 10, 0), row("slow", 500, 60, 30, long=100), row("slow", 750, 60, 40),
            row("fast", 250, 50, 50), row("never", 250, 0, 0), row("never", 500, 99, 0)]
    s0, s1 = tmp_path / "s0.jsonl", tmp_path / "s1.jsonl"
    s0.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s1.write_text(json.dumps(row("slow", 250, 100, 100)) + "\n")
    script = _script()
    assert script.emergence(rows, threshold=50) == {"slow": "750", "fast": "≤ 250", "never": "> 500"}
    assert script.emergence(rows, threshold=45) == {"slow": "500", "fast": "≤ 250", "never": "500"}
    table = script.summarise([str(s0), str(s1)], 50.0).splitlines()
    assert table[0] == "| run | s0 | s1 |" and table[2] == "| slow | 750 | ≤ 250 |"
    assert table[4] == "| never | > 500 | - |"  # a run a file does not have
    script.plot([str(s0), str(s1)], str(tmp_path / "steps.png"))
    assert (tmp_path / "steps.png").stat().st_size > 1000


def test_emergence_by_default_is_every_pair_count_above_its_random_copy_floor():
    def row(run, step, a2, a4, samples=30):
        return {"run": run, "step": step, "samples": samples, "mqar": {"2": {"64": a2}, "4": {"64": a4}}}

    # 30 samples: 2 pairs is 60 answers against 1/2 (40 right, 66.7%, is p ≈ 0.007; 36, 60%, p ≈ 0.08),
    # 4 pairs 120 answers against 1/4. The format-1 threshold of 50% would call the first two steps learned.
    rows = [row("a", 250, 60.0, 60.0), row("a", 500, 66.7, 30.0), row("a", 750, 66.7, 40.0),
            row("b", 250, 100.0, 100.0, samples=5), row("c", 250, 50.0, 25.0)]
    script = _script()
    assert script.emergence(rows) == {"a": "750", "b": "≤ 250", "c": "> 250"}
    assert script.emergence(rows, threshold=50)["a"] == "≤ 250"
