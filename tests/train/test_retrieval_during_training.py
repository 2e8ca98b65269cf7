"""scripts/retrieval_during_training.py: scores a run's checkpoints and its final model, once each."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from fusedkv.cli import main

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "retrieval_during_training.py"


def _script():
    spec = importlib.util.spec_from_file_location("retrieval_during_training", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
