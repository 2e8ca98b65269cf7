"""`fusedkv eval` under bad input and broken checkpoints, through the real CLI: every flag range-checked
before the model loads, every path checked before any work, a non-finite loss an error (exit 1)."""

from __future__ import annotations

import pytest

from tests.reliability.conftest import CONTEXT, assert_one_line_error


def ev(cli, ckpt, val, *args):
    return cli("eval", ckpt, "--val", val, "--tasks", "none", "--max-batches", "1", *args)


def test_eval_runs(cli, tiny_ckpt, tiny_val, tmp_path):
    r = ev(cli, tiny_ckpt, tiny_val, "--json", tmp_path / "r.json")
    assert r.returncode == 0, r.stderr
    assert "validation loss" in r.stdout and (tmp_path / "r.json").is_file()


@pytest.mark.parametrize("args, fragment", [
    (("--batch-size", "0"), "argument --batch-size: must be at least 1"),  # was ZeroDivisionError
    (("--max-batches", "0"), "argument --max-batches: must be at least 1"),
    (("--max-batches", "-1"), "argument --max-batches: must be at least 1"),
    (("--seq-len", "0"), "argument --seq-len: must be at least 2"),  # was silently the default
    (("--seq-len", "1"), "argument --seq-len: must be at least 2"),
    (("--seq-len", "abc"), "argument --seq-len: expected an integer"),
    (("--stride", "0"), "argument --stride: must be at least 1"),  # was silently the default
    (("--stride", "-3"), "argument --stride: must be at least 1"),  # was a 57 s run of stride 1
    (("--limit", "0"), "argument --limit: must be in (0, inf]"),
    (("--limit", "-1"), "argument --limit: must be in (0, inf]"),
    (("--limit", "nan"), "argument --limit: expected a finite number"),
    (("--num-fewshot", "-1"), "argument --num-fewshot: must be at least 0"),  # was exit 0
    (("--tasks", ""), "argument --tasks: must not be empty"),  # was KeyError
    (("--ruler", "--ruler-lengths", "abc"), "argument --ruler-lengths: expected an integer, got 'abc'"),
    (("--ruler", "--ruler-lengths", "0"), "argument --ruler-lengths: must be at least 2"),
    (("--ruler", "--ruler-lengths", ","), "argument --ruler-lengths: expected a comma-separated list"),
    (("--ruler", "--ruler-samples", "0"), "argument --ruler-samples: must be at least 1"),  # was all-zero scores
    (("--ruler", "--ruler-max-new-tokens", "0"), "argument --ruler-max-new-tokens: must be at least 1"),
    (("--ruler", "--ruler-max-new-tokens", "99999999999"), "must be at most 2,147,483,647"),
])
def test_flags_are_range_checked(cli, tiny_ckpt, tiny_val, args, fragment):
    assert_one_line_error(ev(cli, tiny_ckpt, tiny_val, *args), 2, "fusedkv eval: error:", fragment)


@pytest.mark.parametrize("args, fragment", [
    (("--seq-len", "100000"), f"--seq-len 100000 exceeds the model context {CONTEXT}"),
    (("--ruler", "--ruler-lengths", "128"), f"--ruler-lengths 128 exceeds the model context {CONTEXT}"),
    (("--ruler", "--ruler-lengths", "64"), "--ruler-lengths 64 leaves no room for a prompt"),
    (("--ruler", "--ruler-lengths", "64", "--ruler-tasks", "bogus"), "--ruler-tasks: unknown task(s) bogus"),
])
def test_values_beyond_the_model_are_refused(cli, tiny_ckpt, tiny_val, args, fragment):
    assert_one_line_error(ev(cli, tiny_ckpt, tiny_val, *args), 2, fragment)


@pytest.mark.parametrize("flag, name, fragment", [
    ("--text", "a-directory", "is a directory"),  # was IsADirectoryError
    ("--text", "missing", "does not exist"),
    ("--text", "empty.txt", "is empty"),
    ("--text", "random.bin", "does not look like text"),  # was a hang on U+FFFD garbage
    ("--text", "program", "does not look like text"),
    ("--json", "a-directory", "is a directory"),  # was IsADirectoryError after the whole evaluation
    ("--val", "missing", "no such file or directory"),
    ("--val", "random.bin", "no metadata file"),
])
def test_bad_paths_are_refused_before_work(cli, tiny_ckpt, tiny_val, bad_files, flag, name, fragment):
    line = assert_one_line_error(ev(cli, tiny_ckpt, tiny_val, flag, bad_files[name]), 2, fragment)
    assert str(bad_files[name]) in line


def test_json_in_a_missing_directory_is_refused_before_work(cli, tiny_ckpt, tiny_val, tmp_path):
    r = ev(cli, tiny_ckpt, tiny_val, "--json", tmp_path / "no" / "dir" / "r.json")
    assert_one_line_error(r, 2, "--json", "does not exist")
    assert "validation loss" not in r.stdout


def test_checkpoint_that_is_not_one(cli, tiny_val, bad_files, qwen3_src):
    assert_one_line_error(ev(cli, bad_files["a-directory"], tiny_val), 2, "no config.json")
    assert_one_line_error(ev(cli, bad_files["random.bin"], tiny_val), 2, "random.bin")
    assert_one_line_error(ev(cli, qwen3_src, tiny_val), 2, "fusedkv convert")


def test_nan_weights_fail_instead_of_printing_nan(cli, nan_ckpt, overflow_ckpt, tiny_val):
    """Corrupted weights gave "validation loss nan" with exit 0. Now a NaN weight is refused at load
    (exit 2), and finite weights whose logits overflow fail while running (exit 1)."""
    r = ev(cli, nan_ckpt, tiny_val)
    assert_one_line_error(r, 2, "holds non-finite weights", "model.norm.weight")
    assert "nan" not in r.stdout
    r = ev(cli, overflow_ckpt, tiny_val)
    assert_one_line_error(r, 1, "validation loss is nan", "not finite")
    assert "nan" not in r.stdout


@pytest.mark.slow
def test_unknown_lm_eval_task(cli, tiny_ckpt, tiny_val):
    """Was a KeyError traceback from lm-eval's task index (indexing its tasks takes a while)."""
    r = cli("eval", tiny_ckpt, "--val", tiny_val, "--max-batches", "1", "--tasks", "bogus_task", timeout=300)
    assert_one_line_error(r, 2, "--tasks", "bogus_task")


def test_full_disk_names_the_file_that_could_not_be_written(cli, tiny_ckpt, tiny_val, full_disk):
    r = ev(cli, tiny_ckpt, tiny_val, "--json", full_disk / "results.json")
    assert_one_line_error(r, 1, "no space left on the device", str(full_disk / "results.json"))
