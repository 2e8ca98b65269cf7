"""One CLI pattern and one error policy for every subcommand, checked through the real command line:
help that lists every command, exit 2 with one line for bad input, --debug / FUSEDKV_DEBUG=1 for the
traceback, --device refused up front when this build cannot use it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.reliability.conftest import REPO, assert_one_line_error, base_env

COMMANDS = ("plans", "train", "generate", "convert", "eval", "compare", "bench", "analyze")
BAD = ("plans", "--heads", "3", "--kv-heads", "2")  # passes argparse, refused by the model config


def test_help_lists_every_command_and_the_exit_codes(cli):
    r = cli("--help")
    assert r.returncode == 0
    for command in COMMANDS:
        assert f"\n    {command} " in r.stdout, command
    assert "exit status" in r.stdout and "--debug" in r.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_and_debug(cli, command):
    r = cli(command, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: fusedkv {command}") and "--debug" in r.stdout


def test_bad_input_is_one_line_with_exit_2(cli):
    assert_one_line_error(cli(*BAD), 2, "fusedkv plans: error:", "num_key_value_heads=2")


@pytest.mark.parametrize("how", ["--debug before", "--debug after", "FUSEDKV_DEBUG=1"])
def test_debug_shows_the_traceback(cli, how):
    if how == "--debug before":
        r = cli("--debug", *BAD)
    elif how == "--debug after":
        r = cli(*BAD, "--debug")
    else:
        r = cli(*BAD, env={"FUSEDKV_DEBUG": "1"})
    assert r.returncode == 1  # Python's own exit status for an uncaught exception
    assert "Traceback" in r.stderr and "ValueError: num_attention_heads=3" in r.stderr


def test_unknown_command_and_flag_are_one_line(cli):
    r = cli("bogus")
    assert r.returncode == 2 and "invalid choice: 'bogus'" in r.error_line() and "Traceback" not in r.stderr
    r = cli("plans", "--no-such-flag")
    assert r.returncode == 2 and r.error_line().startswith("fusedkv plans: error: unrecognized arguments")


def test_no_command_prints_help(cli):
    r = cli()
    assert r.returncode == 0 and "usage: fusedkv" in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("argv", [
    ("generate", "{ckpt}", "--device", "cuda"),
    ("bench", "--device", "cuda", "--no-hf", "--prompt-lens", "8", "--batch-sizes", "1"),
    ("train", "--device", "cuda", "--preset", "nano", "--max-steps", "1", "--out", "{tmp}/run"),
    ("generate", "{ckpt}", "--device", "cuda:3"),
])
def test_device_cuda_on_a_cpu_build_is_refused_up_front(cli, tiny_ckpt, tmp_path, argv):
    argv = [a.format(ckpt=tiny_ckpt, tmp=tmp_path) for a in argv]
    assert_one_line_error(cli(*argv), 2, "--device cuda", "use --device cpu")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("device", ["banana", "mps"])
def test_device_that_is_no_device(cli, tiny_ckpt, device):
    assert_one_line_error(cli("generate", tiny_ckpt, "--device", device), 2, f"--device: device '{device}'")


@pytest.mark.slow
def test_the_harness_runs_what_a_fresh_interpreter_runs(cli):
    """The forked children of the suite's zygote give the same status and message as `python -m` and the
    installed console script."""
    ours = cli(*BAD)
    # The two fresh interpreters start side by side (each spends seconds importing torch and transformers).
    script = shutil.which("fusedkv") or str(Path(sys.executable).with_name("fusedkv"))
    commands = [[sys.executable, "-m", "fusedkv.cli", *BAD]] + ([[script, *BAD]] if Path(script).exists() else [])
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=base_env(),
                              cwd=REPO) for cmd in commands]
    results = [(p, p.communicate(timeout=300)[1]) for p in procs]
    fresh, fresh_err = results[0]
    assert (fresh.returncode, fresh_err.strip().splitlines()[-1]) == (ours.returncode, ours.error_line())
    for installed, installed_err in results[1:]:
        assert installed.returncode == 2 and installed_err.strip().splitlines()[-1] == ours.error_line()


@pytest.mark.slow
def test_train_module_entry_point_follows_the_same_policy(cli, tmp_path):
    """`python -m fusedkv.train.command` (what torchrun launches) reports like `fusedkv train` (run as the
    harness runs every module: the test above checks that it runs what a fresh interpreter runs)."""
    r = cli.runner.run("fusedkv.train.command", ["--preset", "nano", "--max-steps", "0", "--out", tmp_path / "run"],
                       env=base_env(), cwd=REPO, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "max" in r.stderr.strip().splitlines()[-1]
