"""Chained experiment runs (`from:` / `distill:`) and retrieval evaluation in `fusedkv compare`, at nano size."""

import json
import shutil

import pytest

from fusedkv.cli import main
from fusedkv.experiments import load_experiment, run_experiment
from tests.experiments.nano_experiments import nano_corpus, nano_experiment


def test_evidence_experiments_load():
    runs = {r["name"]: r for r in load_experiment("uptrain")["runs"]}
    assert runs["lite-uptrain-distill"]["from"] == runs["lite-uptrain-distill"]["distill"] == "teacher-vanilla"
    assert runs["fusedkv-uptrain-lm"]["plan"] == "fusedkv" and "distill" not in runs["fusedkv-uptrain-lm"]
    retrieval = load_experiment("retrieval")
    assert retrieval["base"]["data"].startswith("mix:builtin:") and "retrieval" in retrieval["evaluate"]
    assert {r["plan"] for r in retrieval["runs"]} == {"vanilla", "vanilla+gqa", "cla", "yoco", "fusedkv-lite",
                                                       "fusedkv"}
    assert load_experiment("long")["base"]["max_steps"] >= 10 * load_experiment("main")["base"]["max_steps"]
    # passkey: retrieval's stage-1 runs as they are (the same cache keys), continued on passkey documents
    passkey = load_experiment("passkey")
    assert passkey["base"] == retrieval["base"] and passkey["evaluate"] == retrieval["evaluate"]
    stage1 = [r for r in passkey["runs"] if "from" not in r]
    assert stage1 and all(r in retrieval["runs"] for r in stage1)
    assert all(":tasks=mqar+repeat+passkey:" in r["data"] for r in passkey["runs"] if "from" in r)


@pytest.mark.slow
def test_chain_converts_distils_shifts_curves_and_resumes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FUSEDKV_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("FUSEDKV_COMPARE_CACHE", str(tmp_path / "cache"))
    spec_file = nano_experiment(
        tmp_path, "max_steps: 4, eval_every: 2, threads: 1, ckpt_every: 0",
        "evaluate: {retrieval: {lengths: [48, 64, 128], pairs: [1, 2], samples: 2}}\n"
        "runs:\n  - {name: teacher, plan: vanilla}\n"
        "  - {name: lite-lm, from: teacher, plan: fusedkv-lite, max_steps: 2}\n"
        "  - {name: lite-kd, from: teacher, distill: teacher, plan: fusedkv-lite, max_steps: 2, distill_alpha: 0.9}\n")
    out = tmp_path / "out"
    assert main(["compare", str(spec_file), "--out", str(out), "--seeds", "0", "--task-limit", "0"]) == 0
    res = {n: json.loads((out / n / "seed0" / "result.json").read_text()) for n in ("teacher", "lite-lm", "lite-kd")}
    assert res["teacher"]["plan"] == "vanilla" and res["lite-lm"]["plan"] == res["lite-kd"]["plan"] == "fusedkv-lite"
    assert res["lite-lm"]["tokens_offset"] == res["teacher"]["tokens_seen"] == 4 * 512
    # Drawn at total tokens, starting with the converted model's loss before its first step.
    assert res["teacher"]["init_val_loss"] is None and res["lite-lm"]["init_val_loss"] > 0
    assert res["lite-lm"]["curve"][0] == [4 * 512, res["lite-lm"]["init_val_loss"]]
    assert res["lite-lm"]["curve"][1][0] == 4 * 512 + 2 * 512
    assert res["lite-lm"]["val_loss"] != res["lite-kd"]["val_loss"]  # the distillation loss changed training
    cache = tmp_path / "cache"
    assert len(list(cache.glob("*/converted/config.json"))) == 2  # each chained run converted the teacher
    # Retrieval: lengths past the 64-token context are not scored; cells that fit are percentages.
    r = res["teacher"]["retrieval"]
    assert r["lengths"] == [48, 64] and all(v is None or 0 <= v <= 100 for v in r["mqar"]["1"].values())
    report = (out / "retrieval.md").read_text()
    assert report.count("(mean over seeds)\n") == 3 and "| lite-kd | 1 |" in report  # a table per run, a score each
    assert (out / "retrieval.png").stat().st_size > 1000
    # Finished runs are reused: a second call trains nothing and returns the same numbers.
    again = run_experiment(load_experiment(str(spec_file)), out, seeds=[0], progress=False, task_limit=0)
    assert [r["val_loss"] for r in again] == [res[n]["val_loss"] for n in ("teacher", "lite-lm", "lite-kd")]
    # --finished-only: the finished runs' tables, nothing trained; an unfinished run and its chain are listed.
    more = spec_file.read_text() + ("  - {name: other, plan: fusedkv}\n"
                                    "  - {name: other-long, from: other, plan: fusedkv, seq_len: 128}\n"
                                    "claims:\n  - {pair: [lite-lm, teacher], paper: -0.016, source: Table 2}\n"
                                    "  - {pair: [other, teacher], paper: -0.02}\n")  # other: not finished
    spec_file.write_text(more)
    report = tmp_path / "report"
    assert main(["compare", str(spec_file), "--out", str(report), "--seeds", "0,1", "--finished-only",
                 "--task-limit", "0"]) == 0  # as the runs were scored (another limit: tests/reliability)
    printed = capsys.readouterr().out
    assert "not finished: other seed 0" in printed and "not finished: other-long seed 1" in printed
    assert "| lite-kd | fusedkv-lite | 0.5 | 1 |" in (report / "results.md").read_text()
    # The file's claims, judged by the rule: one seed finished, so a direction without a test.
    verdicts = (report / "results.md").read_text().split("Verdicts on the paper's claims:")[1]
    assert "| lite-lm − teacher | -0.016 (Table 2) |" in verdicts and "one seed, no test" in verdicts
    assert "inconclusive" in verdicts and "other − teacher" not in verdicts and "0 tests in this table" in verdicts
    assert not list(report.glob("other*")) and len(list((tmp_path / "cache").glob("*/train"))) == 3
    assert main(["compare", str(spec_file), "--out", str(report), "--seeds", "7", "--finished-only"]) == 2


def test_a_chain_must_name_an_earlier_run(tmp_path):
    spec = {"base": {"preset": "nano"}, "runs": [{"name": "a", "plan": "fusedkv", "from": "b"},
                                                 {"name": "b", "plan": "vanilla"}]}
    with pytest.raises(ValueError, match="must name a run listed before it"):
        run_experiment(spec, tmp_path, seeds=[0], progress=False)


@pytest.mark.slow
def test_a_run_killed_part_way_continues_from_its_checkpoint(tmp_path, monkeypatch, capsys):
    """Long evidence runs must survive the end of a session: rerunning the command resumes the killed run
    from its newest checkpoint (not from step 0) and ends where an uninterrupted run ends."""
    monkeypatch.setenv("FUSEDKV_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("FUSEDKV_COMPARE_CACHE", str(tmp_path / "cache"))
    spec = {"base": {"preset": "nano", "data": str(nano_corpus(tmp_path)), "max_steps": 4, "eval_every": 2,
                     "threads": 1, "ckpt_every": 2}, "runs": [{"name": "lite", "plan": "fusedkv-lite"}]}
    first = run_experiment(spec, tmp_path / "a", seeds=[0], progress=False, task_limit=0)[0]
    # Make it look killed after the step-2 checkpoint: no result, no final model, no later checkpoint.
    train_dir = tmp_path / "cache" / first["checkpoint"].split("/")[-3] / "train"
    for path in [*tmp_path.glob("*/lite/seed0/result.json"), *(tmp_path / "cache").glob("*/result.json")]:
        path.unlink()
    shutil.rmtree(train_dir / "final")
    checkpoints = sorted((train_dir / "checkpoints").iterdir())
    assert [c.name for c in checkpoints][-1].endswith("4") and len(checkpoints) >= 2
    shutil.rmtree(checkpoints[-1])
    kept = (checkpoints[-2], checkpoints[-2].stat().st_mtime_ns)  # a restart from step 0 would rewrite it
    capsys.readouterr()
    again = run_experiment(spec, tmp_path / "a", seeds=[0], progress=True, task_limit=0)[0]
    assert "resuming the interrupted run" in capsys.readouterr().out
    assert kept[0].stat().st_mtime_ns == kept[1] and (train_dir / "final").is_dir()
    assert again["val_loss"] == pytest.approx(first["val_loss"], rel=1e-5)


@pytest.mark.slow
def test_sigterm_stops_a_comparison_cleanly_and_the_rerun_resumes(tmp_path):
    """A comparison stopped by SIGTERM (the end of a working session) saves the running run's checkpoint,
    says how to go on and exits 143; the same command then resumes that run instead of starting over."""
    import signal

    from tests import _cli as cli_process
    from tests.train.train_helpers import REPO, subprocess_env, wait_for

    # 16 steps, 0.2 s apart: the signal lands ~3 s before the first run could end; the rerun trains the rest.
    spec_file = nano_experiment(tmp_path, "max_steps: 16, eval_every: 0, threads: 1, ckpt_every: 0",
                                "runs:\n  - {name: lite, plan: fusedkv-lite}\n")
    env = subprocess_env(FUSEDKV_TRAIN_STEP_SLEEP="0.2", FUSEDKV_DATA_DIR=str(tmp_path / "data"),
                         FUSEDKV_COMPARE_CACHE=str(tmp_path / "cache"))
    args = ["compare", str(spec_file), "--out", str(tmp_path / "out"), "--seeds", "0", "--task-limit", "0"]
    proc = cli_process.start_module("fusedkv.cli", *args, cwd=REPO, env=env)  # a forked `python -m fusedkv.cli`
    metrics = lambda: list((tmp_path / "cache").glob("*/train/metrics.csv"))  # noqa: E731
    wait_for(lambda: metrics() and metrics()[0].read_text().count("\n") >= 3, proc, what="two logged steps")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM at step" in err and "re-run the same command to resume it" in err
    assert "huggingface" not in err.lower() and not list(tmp_path.glob("out/lite/seed0/result.json"))
    again = cli_process.fusedkv(*args, cwd=REPO, env={**env, "FUSEDKV_TRAIN_STEP_SLEEP": "0"}, timeout=600)
    assert again.returncode == 0, again.stderr
    assert "resuming the interrupted run" in again.stdout
    assert json.loads((tmp_path / "out/lite/seed0/result.json").read_text())["plan"] == "fusedkv-lite"
