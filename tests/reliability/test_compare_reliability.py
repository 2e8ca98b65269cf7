"""`fusedkv compare`: results are reused only for the very settings that made them (#3), run names are
unique (#4), and a user's file can extend a shipped experiment (#18). The real CLI in a child process."""

import json

import pytest

from tests.experiments.nano_experiments import nano_corpus
from tests.reliability.conftest import assert_one_line_error

QUICK = ("--task-limit", "0")


@pytest.fixture
def nano(tmp_path):
    """(experiment file, environment): two nano runs on a small corpus, a private data and result cache."""
    spec = tmp_path / "exp.yaml"
    spec.write_text(f"name: nano\nbase: {{preset: nano, data: {nano_corpus(tmp_path)}, max_steps: 2, eval_every: 2, "
                    "eval_batches: 1, final_eval_batches: 1, threads: 1}\nseeds: [0]\n"
                    "runs:\n  - {name: vanilla, plan: vanilla}\n")
    env = {"FUSEDKV_DATA_DIR": str(tmp_path / "data"), "FUSEDKV_COMPARE_CACHE": str(tmp_path / "cache")}
    return spec, env


@pytest.mark.slow
def test_a_changed_setting_into_the_same_out_trains_again(cli, nano, tmp_path):
    """Was (#3): the second call trained nothing and reported the 2-step result as the 4-step one."""
    spec, env = nano
    out = tmp_path / "out"
    first = cli("compare", spec, "--out", out, *QUICK, env=env, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    two = json.loads((out / "vanilla" / "seed0" / "result.json").read_text())
    again = cli("compare", spec, "--out", out, *QUICK, env=env, timeout=600)  # same settings: reused
    assert again.returncode == 0 and "[1/1]" not in again.stdout
    four = cli("compare", spec, "--out", out, "--set", "max_steps=4", *QUICK, env=env, timeout=600)
    assert four.returncode == 0, four.stderr[-2000:]
    assert "[1/1] vanilla seed 0" in four.stdout  # trained
    result = json.loads((out / "vanilla" / "seed0" / "result.json").read_text())
    assert result["config"]["max_steps"] == 4 and result["tokens_seen"] == 2 * two["tokens_seen"]
    assert result["key"] != two["key"]


@pytest.mark.slow
def test_a_preset_value_changed_through_the_file_is_another_run(cli, nano, tmp_path):
    """The key is the resolved TrainConfig: spelling out a preset's own value is the same run, changing it
    is another."""
    spec, env = nano
    out = tmp_path / "out"
    assert cli("compare", spec, "--out", out, *QUICK, env=env, timeout=600).returncode == 0
    key = json.loads((out / "vanilla" / "seed0" / "result.json").read_text())["key"]
    from fusedkv.train import TrainConfig

    lr = TrainConfig(preset="nano").lr
    r = cli("compare", spec, "--out", out, "--set", f"lr={lr!r}", *QUICK, env=env, timeout=600)
    assert r.returncode == 0 and "[1/1]" not in r.stdout  # the preset's value, spelled out: the same run
    r = cli("compare", spec, "--out", out, "--set", f"lr={lr * 2!r}", *QUICK, env=env, timeout=600)
    assert r.returncode == 0 and "[1/1]" in r.stdout
    assert json.loads((out / "vanilla" / "seed0" / "result.json").read_text())["key"] != key


@pytest.mark.slow
def test_another_task_limit_rescores_without_training(cli, nano, tmp_path):
    """A result scored with --task-limit 0 (no tasks) was reused as it was under --task-limit 2."""
    spec, env = nano
    out = tmp_path / "out"
    assert cli("compare", spec, "--out", out, "--task-limit", "0", env=env, timeout=600).returncode == 0
    assert "tasks" not in json.loads((out / "vanilla" / "seed0" / "result.json").read_text())
    r = cli("compare", spec, "--out", out, "--task-limit", "2", env=env, timeout=600)
    assert r.returncode == 0 and "[1/1]" not in r.stdout, r.stderr[-2000:]  # not trained again
    result = json.loads((out / "vanilla" / "seed0" / "result.json").read_text())
    assert result["task_limit"] == 2 and result["tasks"] and "task avg" in (out / "results.md").read_text()


@pytest.mark.parametrize("runs, fragment", [
    ("[{name: fkv, plan: fusedkv}, {name: fkv, plan: fusedkv}]", "run name 'fkv' is used twice"),
    ("[{name: Lite, plan: fusedkv-lite}, {name: lite, plan: fusedkv}]", "share the directory 'lite'"),
])
def test_duplicate_run_names_are_refused(cli, tmp_path, nano, runs, fragment):
    """Was (#4): one of the two runs dropped from the table, "seeds=2" made of one run."""
    spec = nano[0]
    spec.write_text(spec.read_text().split("runs:")[0] + f"runs: {runs}\n")
    r = cli("compare", spec, "--out", tmp_path / "out", "--finished-only", *QUICK, env=nano[1])
    assert_one_line_error(r, 2, fragment)
    assert not (tmp_path / "out").exists()


def test_a_user_file_extends_a_shipped_experiment(cli, tmp_path, nano):
    """Was (#18): `extends: _small` in a user's file said "no experiment '_small.yaml'"."""
    from fusedkv.experiments import load_experiment

    spec = tmp_path / "mine.yaml"
    spec.write_text("extends: _small\nruns: [{name: v, plan: vanilla}]\n")
    loaded = load_experiment(str(spec))
    assert loaded["base"]["model"]["num_hidden_layers"] == 8 and loaded["base"]["max_steps"] == 150
    # Through the CLI: nothing finished yet, but the file (and its parent) resolved.
    r = cli("compare", spec, "--out", tmp_path / "out", "--finished-only", *QUICK, env=nano[1])
    assert_one_line_error(r, 2, "no run of 'mine' has finished yet")
    assert "not finished: v seed 0" in r.stdout
    (tmp_path / "main.yaml").write_text("extends: _small\nruns: [{name: local, plan: vanilla}]\n")
    spec.write_text("extends: main\n")  # a file beside it wins over the shipped one of that name
    assert [r["name"] for r in load_experiment(str(spec))["runs"]] == ["local"]
    spec.write_text("extends: no-such-parent\n")
    assert_one_line_error(cli("compare", spec, *QUICK), 2, "extends: 'no-such-parent' is neither a file")


def _row(name="vanilla", seed=0, key="k0", val_loss=3.5, **extra):
    return {"name": name, "seed": seed, "key": key, "val_loss": val_loss, "val_ppl": 33.1, **extra}


@pytest.mark.parametrize("rows,fragments", [
    # issue 41, defect 5: a second row of one run replaced its loss (the table's mean from the wrong row)
    ([_row(), _row(name="fusedkv", key="k1"), _row(val_loss=9.0)], ("rows 0 and 2", "'vanilla' seed 0")),
    ([_row(), _row(name="other", key="k0")], ("rows 0 and 1", "key k0")),
    ([_row(), _row(name="fusedkv", key="k1", val_loss="3.1")], ("row 1", "'fusedkv' seed 0", "val_loss '3.1'")),
    ([_row(val_loss=float("nan"))], ("row 0", "val_loss nan")),
    ([_row(val_loss=True)], ("row 0", "val_loss True")),
    ([_row(val_ppl="x")], ("row 0", "val_ppl 'x'")),
    ([_row(seed="0")], ("row 0", "seed '0'")),
], ids=["duplicate-run", "duplicate-key", "string-loss", "nan-loss", "bool-loss", "string-ppl", "string-seed"])
def test_a_record_with_a_duplicate_or_a_non_number_is_refused_naming_the_row(cli, tmp_path, rows, fragments):
    record = tmp_path / "record.json"
    record.write_text(json.dumps(rows))  # NaN as JSON's NaN, as json.dumps writes it
    r = cli("compare", "main", "--record", record, "--finished-only", "--out", tmp_path / "out", *QUICK)
    assert_one_line_error(r, 2, "--record", *fragments)
    assert not (tmp_path / "out").exists()
