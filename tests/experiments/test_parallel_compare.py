"""Several `fusedkv compare` processes on one comparison (one per core), and `--runs`: each (run, seed) is
trained by exactly one process, the others wait for it or take the next run, and every process writes the
tables of all of them."""

import json
import re
import subprocess
import sys
import textwrap

import pytest

from fusedkv.cli import main
from fusedkv.experiments.runner import RunLock
from fusedkv.experiments.spec import selected_runs
from tests.experiments.nano_experiments import nano_experiment

RUNS = [{"name": "teacher", "plan": "vanilla"}, {"name": "lite", "plan": "fusedkv-lite"},
        {"name": "lite-kd", "plan": "fusedkv-lite", "from": "teacher", "distill": "teacher"},
        {"name": "long", "plan": "fusedkv-lite", "from": "lite-kd"}]


def test_runs_are_the_named_ones_and_those_they_start_from():
    names = lambda only: [r["name"] for r in selected_runs(RUNS, only)]  # noqa: E731
    assert names(None) == ["teacher", "lite", "lite-kd", "long"]
    assert names(["lite"]) == ["lite"]
    assert names(["long"]) == ["teacher", "lite-kd", "long"]  # its chain, transitively, in the file's order
    assert names(["lite", "teacher"]) == ["teacher", "lite"]
    with pytest.raises(ValueError, match=r"no run named 'lyte'.*its runs: teacher, lite, lite-kd, long"):
        selected_runs(RUNS, ["lyte"])


def test_an_unknown_run_name_is_a_usage_error(tmp_path, capsys):
    spec = nano_experiment(tmp_path, "max_steps: 2", "runs:\n  - {name: a, plan: vanilla}\n")
    assert main(["compare", str(spec), "--runs", "a,b", "--out", str(tmp_path / "out")]) == 2
    assert "no run named 'b'" in capsys.readouterr().err


def test_a_run_lock_excludes_other_processes_until_its_holder_ends(tmp_path):
    """The lock is a kernel flock: a second process cannot take it while the first lives, and it is free
    the moment the first dies, even by SIGKILL (no stale lock to clean up)."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from fusedkv.experiments.runner import RunLock
        with RunLock({str(tmp_path)!r}) as lock:
            print(lock.held, flush=True)
            time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "True"
        with RunLock(tmp_path) as lock:
            assert not lock.held
        assert re.fullmatch(rf"pid {holder.pid} on .+\n", (tmp_path / "lock").read_text())
    finally:
        holder.kill()
        holder.wait()
    with RunLock(tmp_path) as lock:
        assert lock.held
        with RunLock(tmp_path) as again:  # another open file description: refused, as for another process
            assert not again.held
    with RunLock(tmp_path) as lock:
        assert lock.held


@pytest.mark.slow
def test_two_processes_share_one_comparison(tmp_path):
    """Two commands started together on a fresh machine: the dataset is prepared once (the second waits),
    every run is trained by one of them, a chained run waits for its ancestor wherever it trains, and both
    write the whole table."""
    from tests import _cli as cli_process
    from tests.train.train_helpers import REPO, subprocess_env

    runs = "runs:\n" + "".join(f"  - {json.dumps(r)}\n" for r in RUNS[:3])
    spec = nano_experiment(tmp_path, "max_steps: 6, eval_every: 0, threads: 1, ckpt_every: 0", runs)
    env = subprocess_env(FUSEDKV_TRAIN_STEP_SLEEP="0.3", FUSEDKV_DATA_DIR=str(tmp_path / "data"),
                         FUSEDKV_COMPARE_CACHE=str(tmp_path / "cache"))
    procs = [cli_process.start_module("fusedkv.cli", "compare", str(spec), "--out", str(tmp_path / f"out{i}"),
                                      "--seeds", "0", "--task-limit", "0", cwd=REPO, env=env) for i in (0, 1)]
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err
    started = [m for out, _ in outputs for m in re.findall(r"^\[\d/3\] (\S+) seed 0$", out, re.M)]
    assert sorted(started) == ["lite", "lite-kd", "teacher"]  # each trained once, by one of the two
    assert len(list((tmp_path / "cache").glob("*/train/final"))) == 3
    for i in (0, 1):
        table = (tmp_path / f"out{i}" / "results.md").read_text()
        assert all(f"| {name} |" in table for name in ("teacher", "lite", "lite-kd"))
    keys = [{n: json.loads((tmp_path / f"out{i}" / n / "seed0" / "result.json").read_text())["val_loss"]
             for n in ("teacher", "lite", "lite-kd")} for i in (0, 1)]
    assert keys[0] == keys[1]
    # Two datasets (a BPE trained for the teacher; the chained run's tokens under the teacher's tokenizer),
    # each prepared once by whichever process came first, the other reusing it: both finished, nothing left over.
    datasets = sorted(p.parent.name for p in (tmp_path / "data").glob("*/meta.json"))
    assert len(datasets) == 2 and datasets[1].endswith("-v512") and "-tok-" in datasets[0]
    assert not [p for p in (tmp_path / "data").rglob("*") if ".tmp" in p.name]
