"""`fusedkv train` under faults a user can cause, each driven through the real CLI in a subprocess:
two runs into one --out, --overwrite with a bad setting, corrupted final weights, a full disk during
a checkpoint save, resuming from a corrupt latest checkpoint or a finished run."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fusedkv import FusedKVForCausalLM
from tests import _cli as cli_process
from tests.train.train_helpers import wait_for

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    e = dict(os.environ)
    e.update(
        PYTHONPATH=str(REPO) + os.pathsep + e.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        FUSEDKV_DATA_DIR=str(tmp_path_factory.mktemp("data-cache")),
    )
    e.pop("FUSEDKV_DEBUG", None)
    return e


def start(env, *args, step_sleep: float = 0.0):
    """`python -m fusedkv.train.command ARGS` left running (Popen-like), forked like `run`'s (tests/_cli.py)."""
    return cli_process.start_module("fusedkv.train.command", *args, cwd=REPO,
                                    env={**env, "FUSEDKV_TRAIN_STEP_SLEEP": str(step_sleep)})


def run(env, *args, timeout=300) -> cli_process.Result:
    """What `start` runs, to its end: a child forked from a process that imported fusedkv once (tests/_cli.py)."""
    return cli_process.run_module("fusedkv.train.command", *args, env={**env, "FUSEDKV_TRAIN_STEP_SLEEP": "0.0"},
                                  cwd=REPO, timeout=timeout)


def nano(data, out, *extra):
    return ("--preset", "nano", "--data", data, "--out", out, "--set", "threads=1", "--quiet", *extra)


def one_line_error(proc) -> str:
    err = proc.stderr.strip()
    assert "Traceback" not in err, err
    assert err.startswith("fusedkv train: error: "), err
    return err


@pytest.mark.slow
def test_second_run_into_the_same_out_is_refused_and_a_killed_run_leaves_no_lock(tmp_path, env, data):
    out = tmp_path / "run"
    first = start(env, *nano(data, out, "--max-steps", 1000, "--set", "ckpt_every=2"), step_sleep=0.3)
    try:
        wait_for(lambda: (out / "checkpoints" / "step-00000002").is_dir(), first, what="a first checkpoint")
        for extra in ((), ("--overwrite",), ("--resume",)):
            t0 = time.time()
            second = run(env, *nano(data, out, "--max-steps", 1000, *extra))
            assert second.returncode == 2, second.stderr
            msg = one_line_error(second)
            assert f"in use by pid {first.pid} on host" in msg and "-m fusedkv.train.command --preset nano" in msg, msg
            assert time.time() - t0 < 60  # refused at once, not after preparing data or a model
        assert first.poll() is None  # the first run was not disturbed
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    # The kernel released the lock with the process: resuming needs no clean-up.
    last = max(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*"))
    resumed = run(env, "--out", out, "--resume", "--max-steps", last + 2, "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    rows = (out / "metrics.csv").read_text().strip().splitlines()[1:]
    assert [int(r.split(",")[0]) for r in rows] == list(range(1, last + 3))


def snapshot(root: Path) -> dict:
    """Path -> SHA-256 of every file below root, but the lock file (proves nothing was touched)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


@pytest.mark.slow
def test_overwrite_touches_nothing_until_the_new_run_is_known_to_start(tmp_path, env, data):
    out = tmp_path / "run"
    first = run(env, *nano(data, out, "--max-steps", 2))
    assert first.returncode == 0, first.stderr
    before = snapshot(out)
    assert {"summary.json", "learning_curves.png", "final/model.safetensors"} <= set(before)
    for bad in (
        ("--set", "model.rms_norm_eps=abc"),  # a type error in the model config
        ("--set", "model.hidden_size=abc"),
        ("--set", "model.num_attention_heads=5"),  # only the model constructor can tell
        ("--data", tmp_path / "missing.txt"),  # fails while preparing data
    ):
        args = list(nano(data, out, "--max-steps", 2, "--overwrite"))
        args[args.index("--data") + 1] = bad[1] if bad[0] == "--data" else data
        p = run(env, *args, *(bad if bad[0] == "--set" else ()))
        assert p.returncode == 2, p.stderr
        msg = one_line_error(p)
        assert "rms_norm_eps" in msg or "hidden_size" in msg or "num_attention_heads" in msg or "missing" in msg
        assert snapshot(out) == before, f"{bad} changed the old run"
    # A good --overwrite replaces the old run entirely: no stale checkpoint, event file or summary.
    (out / "checkpoints" / "step-00000002").rename(out / "checkpoints" / "step-00000099")  # an "old" one
    p = run(env, *nano(data, out, "--max-steps", 1, "--overwrite", "--plan", "vanilla"))
    assert p.returncode == 0, p.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["plan"] == "vanilla" and summary["steps"] == 1
    assert [c.name for c in (out / "checkpoints").iterdir()] == ["step-00000001"]
    assert len(list((out / "tb").glob("events.out.tfevents.*"))) == 1


def test_corrupt_final_weights_are_refused_on_load(tmp_path, env, data):
    out = tmp_path / "run"
    assert run(env, *nano(data, out, "--max-steps", 1)).returncode == 0
    final = out / "final"
    manifest = json.loads((final / "manifest.json").read_text())
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(manifest["files"])
    assert FusedKVForCausalLM.from_pretrained(final) is not None  # intact: loads
    # Damage bytes inside the tensor data (the header still parses, sizes are unchanged).
    weights = final / "model.safetensors"
    good = weights.read_bytes()
    raw = bytearray(good)
    raw[len(raw) - 1000 : len(raw) - 996] = b"\xff\xff\xff\x7f"
    weights.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"model\.safetensors does not match its SHA-256"):
        FusedKVForCausalLM.from_pretrained(final)
    for args in (
        ("-m", "fusedkv.cli", "generate", final, "--greedy", "--max-new-tokens", 3),
        ("-m", "fusedkv.train.command", *nano(data, tmp_path / "next", "--init-from", final)),
    ):
        p = cli_process.run_module(*args[1:], env=env, cwd=REPO)
        assert p.returncode == 2, p.stderr
        assert "Traceback" not in p.stderr and "does not match its SHA-256" in p.stderr
    # A model directory without a manifest (save_pretrained by a user, fusedkv convert) still loads.
    weights.write_bytes(good)
    FusedKVForCausalLM.from_pretrained(final).save_pretrained(tmp_path / "user-saved")
    assert not (tmp_path / "user-saved" / "manifest.json").exists()
    FusedKVForCausalLM.from_pretrained(tmp_path / "user-saved")


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of a given size (root only: skipped otherwise); unmounted afterwards."""
    mounted = []

    def mount(size_bytes: int) -> Path:
        d = tmp_path / f"disk{len(mounted)}"
        d.mkdir()
        opts = f"size={max(size_bytes // 1024, 64)}k"
        if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(d)]).returncode:
            pytest.skip("needs root to mount a small tmpfs")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", str(d)], check=False)


@pytest.mark.slow
def test_full_disk_during_a_checkpoint_save(tmp_path, env, data, small_disk):
    # How much one checkpoint takes, measured on a normal disk.
    probe = tmp_path / "probe"
    assert run(env, *nano(data, probe, "--max-steps", 1)).returncode == 0
    ckpt_bytes = sum(f.stat().st_size for f in (probe / "checkpoints").rglob("*") if f.is_file())
    # Room for the first checkpoint and half of the second.
    out = small_disk(int(1.5 * ckpt_bytes) + 256 * 1024) / "run"
    p = run(env, *nano(data, out, "--max-steps", 4, "--set", "ckpt_every=1"))
    assert p.returncode == 1, p.stderr
    msg = one_line_error(p)
    assert "no space left on the device" in msg, msg
    assert f"could not write {out}/checkpoints/.tmp-step-" in msg  # the file that failed
    good = f"{out}/checkpoints/step-00000001"
    assert f"the last good checkpoint is {good}" in msg, msg
    # The failed save left no temporary directory; the good checkpoint verifies and resumes.
    assert [c.name for c in (out / "checkpoints").iterdir()] == ["step-00000001"]
    subprocess.run(["mount", "-o", "remount,size=64m", str(out.parent)], check=True)
    p = run(env, "--resume", out, "--quiet")
    assert p.returncode == 0, p.stderr
    assert json.loads((out / "summary.json").read_text())["steps"] == 4


@pytest.mark.slow
def test_resume_run_dir_falls_back_past_a_corrupt_checkpoint_and_a_finished_run_says_so(tmp_path, env, data):
    out = tmp_path / "run"
    assert run(env, *nano(data, out, "--max-steps", 4, "--set", "ckpt_every=2")).returncode == 0
    # A finished run: nothing to resume, and the message says what to do instead.
    p = run(env, "--resume", out, "--quiet")
    assert p.returncode == 2 and "already finished (step 4 of 4" in one_line_error(p) and "--max-steps" in p.stderr
    # Corrupt the newest checkpoint: --resume RUN_DIR warns and continues from the previous one.
    weights = out / "checkpoints" / "step-00000004" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-10] ^= 0xFF
    weights.write_bytes(bytes(raw))
    p = run(env, "--resume", out, "--max-steps", 6, "--quiet")
    assert p.returncode == 0, p.stderr
    assert "warning: checkpoint" in p.stderr and "step-00000004 is corrupt" in p.stderr
    assert "resuming from the newest intact one, step-00000002" in p.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and [r["step"] for r in summary["curve"]] == list(range(1, 7))
    # A directory that is neither a run nor a checkpoint.
    p = run(env, "--resume", tmp_path, "--quiet")
    assert p.returncode == 2 and "not a run directory" in one_line_error(p)


@pytest.mark.slow
def test_non_finite_loss_stops_with_exit_1_and_keeps_the_last_good_checkpoint(tmp_path, env, data):
    out = tmp_path / "run"
    # A learning rate of 1e6 with no warm-up blows the weights up within a few steps.
    p = run(env, *nano(data, out, "--max-steps", 8, "--set", "lr=1e6", "--set", "warmup_steps=0",
                       "--set", "ckpt_every=1", "--set", "grad_clip=0"))
    assert p.returncode == 1, p.stderr
    msg = one_line_error(p)
    m = re.search(r"training stopped at step (\d+): .*not finite.*the last good checkpoint (\S+) is untouched", msg)
    assert m, msg
    bad_step, last = int(m.group(1)), Path(m.group(2))
    assert last.name == f"step-{bad_step - 1:08d}" and last.is_dir() and not (out / "final").exists()
    from fusedkv.train.full_checkpoint import verify_checkpoint

    verify_checkpoint(last)
