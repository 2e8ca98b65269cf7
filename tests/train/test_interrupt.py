"""Real interruptions of a `fusedkv train` process: SIGKILL (then --resume) and SIGINT / SIGTERM.

`FUSEDKV_TRAIN_STEP_SLEEP` slows each step down so the signal lands mid-run whatever the machine's
load; it changes nothing else."""

from __future__ import annotations

import csv
import signal

import pytest
from train_helpers import nano_config, subprocess_env, train_cli, wait_for

from fusedkv.train import full_checkpoint as ck
from fusedkv.train import train


def _logged_steps(path) -> int:
    if not path.is_file():
        return 0
    with path.open() as f:
        return max((int(r["step"]) for r in csv.DictReader(f) if r.get("step")), default=0)


@pytest.mark.slow
def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path, nano_data):
    steps = 12
    out = tmp_path / "killed"
    proc = train_cli(
        "--preset",
        "nano",
        "--data",
        nano_data,
        "--out",
        out,
        "--max-steps",
        steps,
        "--set",
        "ckpt_every=2",
        "--set",
        "threads=1",
        "--quiet",
        env=subprocess_env(FUSEDKV_TRAIN_STEP_SLEEP="0.3"),
    )
    # Kill right after the step-4 checkpoint appears (renamed into place only once complete).
    wait_for(lambda: (out / "checkpoints" / "step-00000004").is_dir(), proc, what="the step-4 checkpoint")
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    last = ck.latest_checkpoint(out / "checkpoints")
    resumed_from = int(last.name.split("-")[1])
    assert 4 <= resumed_from < steps

    ref = train(nano_config(tmp_path / "ref", nano_data, max_steps=steps, ckpt_every=2))
    res = train(nano_config(out, nano_data, max_steps=steps, ckpt_every=2, resume=True))
    ref_loss, res_loss = [r["loss"] for r in ref["curve"]], [r["loss"] for r in res["curve"]]
    assert len(res_loss) == steps
    # Every step after the resume point equals the uninterrupted run's (and so do the ones before).
    assert res_loss == pytest.approx(ref_loss, abs=1e-6, rel=0)
    assert res["val_loss"] == pytest.approx(ref["val_loss"], abs=1e-6)
    # Rows the killed run logged after its last checkpoint were replaced, not duplicated.
    with (out / "metrics.csv").open() as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == list(range(1, steps + 1))


# The fast tier (-m 'not slow') stops a run with SIGINT (Ctrl-C); the full suite also with SIGTERM.
@pytest.mark.parametrize("sig, rc", [(signal.SIGINT, 130), pytest.param(signal.SIGTERM, 143, marks=pytest.mark.slow)])
def test_signal_saves_checkpoint_and_exits_cleanly(tmp_path, nano_data, sig, rc):
    out = tmp_path / "run"
    proc = train_cli(
        "--preset",
        "nano",
        "--data",
        nano_data,
        "--out",
        out,
        "--max-steps",
        200,
        "--set",
        "threads=1",
        env=subprocess_env(FUSEDKV_TRAIN_STEP_SLEEP="0.1"),
    )
    wait_for(lambda: _logged_steps(out / "metrics.csv") >= 2, proc, what="two logged steps")
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == rc, stderr
    assert f"stopped by {signal.Signals(sig).name}" in stdout and "--resume" in stdout
    done = _logged_steps(out / "metrics.csv")
    latest = ck.latest_checkpoint(out / "checkpoints")
    assert latest is not None and latest.name == ck.step_dir_name(done)  # saved at the step it stopped
    ck.verify_checkpoint(latest)
    assert not (out / "final").exists()
