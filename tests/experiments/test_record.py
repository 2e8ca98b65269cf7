"""A committed record of a comparison (`fusedkv.experiments.record`, `fusedkv compare --record`): on a
machine without runs/, the tables are written from it, identical to those of the machine that trained
the runs; a row is used only under its own cache key and task limit; a run that must train from a run
known only from the record is refused with a message naming both."""

import json

import pytest

from fusedkv.cli import main
from fusedkv.errors import UsageError
from fusedkv.experiments import record
from fusedkv.utils import write_json_atomic
from tests.experiments.nano_experiments import nano_experiment


def test_rows_merge_by_run_and_seed_and_drop_local_paths():
    results = [{"name": "a", "seed": 1, "key": "k1", "val_loss": 3.0, "checkpoint": "/tmp/x", "config": {}},
               {"name": "a", "seed": 0, "key": "k0", "val_loss": 2.0, "curve": [[0, 4.0]]}]
    rows = record.rows(results)
    assert rows[0] == {"name": "a", "seed": 1, "key": "k1", "val_loss": 3.0}  # no model path, no config
    old = [{"name": "a", "seed": 1, "key": "old", "val_loss": 9.0}, {"name": "b", "seed": 0, "key": "kb",
                                                                     "val_loss": 1.0}]
    assert [(r["name"], r["seed"], r["key"]) for r in record.merged(old, rows)] == [
        ("a", 0, "k0"), ("a", 1, "k1"), ("b", 0, "kb")]  # a's seed 1 replaced, b kept


@pytest.mark.parametrize("text, message", [
    (None, "no such file"), ("{not json", "not a JSON file"), ('{"a": 1}', "a JSON list of result rows"),
    ('[{"name": "a", "seed": 0, "key": "k"}]', "row 0 has no val_loss")])
def test_a_bad_record_is_a_usage_error(tmp_path, text, message):
    path = tmp_path / "record.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(UsageError, match=message):
        record.load(path)


@pytest.mark.slow
def test_tables_are_written_from_the_record_on_a_machine_without_the_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FUSEDKV_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("FUSEDKV_COMPARE_CACHE", str(tmp_path / "cache"))
    runs = ("evaluate: {retrieval: {lengths: [32, 64], pairs: [1, 2], samples: 2}}\nseeds: [0, 1]\n"
            "runs:\n  - {name: base, plan: vanilla}\n  - {name: lite, plan: fusedkv-lite}\n"
            "  - {name: lite-long, from: lite, plan: fusedkv-lite, max_steps: 1}\n")
    spec = nano_experiment(tmp_path, "max_steps: 2, eval_every: 1, threads: 1, ckpt_every: 0", runs)
    trained = tmp_path / "trained"
    assert main(["compare", str(spec), "--out", str(trained), "--task-limit", "0"]) == 0
    results = [json.loads(p.read_text()) for p in sorted(trained.glob("*/seed*/result.json"))]
    assert len(results) == 6
    rec = tmp_path / "record.json"
    write_json_atomic(rec, record.rows(results))
    assert "checkpoint" not in rec.read_text() and "/tmp" not in rec.read_text()

    # Another machine: no run cache, no output folder. Without the record nothing has finished.
    monkeypatch.setenv("FUSEDKV_COMPARE_CACHE", str(tmp_path / "no-cache"))
    capsys.readouterr()
    assert main(["compare", str(spec), "--out", str(tmp_path / "bare"), "--finished-only", "--task-limit", "0"]) == 2
    assert "has finished yet" in capsys.readouterr().err
    from_record = tmp_path / "from-record"
    assert main(["compare", str(spec), "--out", str(from_record), "--finished-only", "--task-limit", "0",
                 "--record", str(rec)]) == 0
    for table in ("results.md", "retrieval.md"):
        assert (from_record / table).read_text() == (trained / table).read_text()
    assert not list(from_record.glob("*/seed*/result.json"))  # recorded runs are not copied as local runs
    assert not (tmp_path / "no-cache").exists() or not list((tmp_path / "no-cache").iterdir())

    # A row counts only under its own key and task limit: other settings are other runs.
    for other in (["--set", "max_steps=3"], ["--task-limit", "5"]):
        capsys.readouterr()
        assert main(["compare", str(spec), "--out", str(tmp_path / "other"), "--finished-only", "--record", str(rec),
                     *(["--task-limit", "0"] if other[0] == "--set" else []), *other]) == 2
        printed = capsys.readouterr()
        assert "has finished yet" in printed.err
        assert ("(recorded under --task-limit 0)" in printed.out) == (other[0] == "--task-limit")  # says why

    # A new run that would train from a recorded run: its model is not here.
    spec.write_text(spec.read_text() + "  - {name: lite-longer, from: lite, plan: fusedkv-lite, max_steps: 2}\n")
    capsys.readouterr()
    assert main(["compare", str(spec), "--out", str(tmp_path / "more"), "--task-limit", "0", "--runs", "lite-longer",
                 "--record", str(rec)]) == 2
    err = capsys.readouterr().err
    assert "run 'lite-longer' seed 0 starts from 'lite' (from:)" in err and "only in the --record file" in err
    assert not (tmp_path / "no-cache").exists() or not list((tmp_path / "no-cache").glob("*/train"))
