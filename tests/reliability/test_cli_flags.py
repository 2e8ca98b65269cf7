"""Every numeric flag of `plans`, `bench`, `compare`, `analyze`, `prune` and `plan-run` is range-checked
before any work, with a message naming the flag; paths are checked before minutes of work. Each case is the
real CLI in a child process (see conftest.py). The comments say what the same command did before."""

from __future__ import annotations

import pytest

from tests.reliability.conftest import assert_one_line_error

TINY_BENCH = ("--no-hf", "--plans", "vanilla", "--prompt-lens", "8", "--batch-sizes", "1", "--repeats", "1",
              "--layers", "2", "--hidden", "64", "--heads", "2", "--head-dim", "32", "--vocab", "64",
              "--new-tokens", "2")


@pytest.mark.parametrize("argv, fragment", [
    (("plans", "--layers", "0"), "argument --layers: must be between 2 and 4096, got 0"),
    (("plans", "--layers", "1000000000"), "argument --layers: must be between 2 and 4096"),  # was a hang
    (("plans", "--heads", "0"), "argument --heads: must be between 1 and 4096"),
    (("plans", "--kv-heads", "0"), "argument --kv-heads: must be between 1 and 4096"),  # was exit 0
    (("plans", "--head-dim", "-2"), "argument --head-dim: must be between 2 and 4096"),
    (("plans", "--bytes", "0"), "argument --bytes: must be between 1 and 8"),  # was ZeroDivisionError
    (("plans", "--seq-len", "-1"), "argument --seq-len: must be at least 1"),  # was negative byte counts
    (("plans", "--seq-len", "1e3"), "argument --seq-len: expected an integer, got '1e3'"),
    (("bench", "--prompt-lens", ""), "argument --prompt-lens: expected a comma-separated list"),
    (("bench", "--prompt-lens", "0"), "argument --prompt-lens: must be between 1 and"),
    (("bench", "--batch-sizes", "0"), "argument --batch-sizes: must be between 1 and 4096"),
    (("bench", "--repeats", "0"), "argument --repeats: must be between 1 and 1000"),
    (("bench", "--new-tokens", "0"), "argument --new-tokens: must be between 1"),
    (("bench", "--layers", "1"), "argument --layers: must be between 2 and 1024"),
    (("bench", "--heads", "0"), "argument --heads: must be between 1 and 1024"),
    (("bench", "--threads", "0"), "argument --threads: must be between 1 and 1024"),  # was silently ignored
    (("bench", "--threads", "-1"), "argument --threads: must be between 1 and 1024"),
    (("bench", "--dtype", "int8"), "argument --dtype: invalid choice"),
    (("compare", "main", "--seeds", "a,b"), "argument --seeds: expected an integer, got 'a'"),
    (("compare", "main", "--seeds", "-1"), "argument --seeds: must be between 0 and 4294967295"),
    (("compare", "main", "--task-limit", "-1"), "argument --task-limit: must be at least 0"),
    (("analyze", "grads", "x", "--steps", "0"), "argument --steps: must be between 1 and 1000000"),
    (("analyze", "grads", "x", "--batch-size", "0"), "argument --batch-size: must be between 1 and 4096"),
    (("analyze", "grads", "x", "--seq-len", "0"), "argument --seq-len: must be at least 2"),
    (("analyze", "bogus", "x"), "argument analysis: invalid choice: 'bogus'"),
    (("prune", "x", "--out", "y", "--sparsity", "1"), "argument --sparsity: must be in [0, 1)"),
    (("prune", "x", "--out", "y", "--calib-seqs", "0"), "argument --calib-seqs: must be between 1"),
    (("prune", "x", "--out", "y", "--batch-size", "0"), "argument --batch-size: must be between 1 and 4096"),
    (("plan-run", "--mfu", "0"), "argument --mfu: must be in (0, 1]"),
    (("plan-run", "--gpus", "0"), "argument --gpus: must be between 1"),
    (("plan-run", "--peak-tflops", "nan"), "argument --peak-tflops: expected a finite number"),
])
def test_flags_are_range_checked(cli, argv, fragment):
    assert_one_line_error(cli(*argv), 2, f"fusedkv {argv[0]}: error:", fragment)


def test_plans_layout_runs(cli):
    r = cli("plans", "--layers", "4", "--heads", "2", "--head-dim", "32", "--layout")
    assert r.returncode == 0 and "fusedkv" in r.stdout


def test_bench_output_paths_are_checked_before_measuring(cli, bad_files, tmp_path):
    assert_one_line_error(cli("bench", *TINY_BENCH, "--json", bad_files["a-directory"]), 2, "is a directory")
    assert_one_line_error(cli("bench", *TINY_BENCH, "--plot", tmp_path / "no" / "p.png"), 2, "does not exist")


def test_bench_tiny_run(cli, tmp_path):
    r = cli("bench", *TINY_BENCH, "--threads", "1", "--json", tmp_path / "rows.json")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "rows.json").is_file()


@pytest.mark.parametrize("name, fragment", [
    ("random.bin", "is not a UTF-8 YAML file"),  # was a UnicodeDecodeError without the file
    ("a-directory", "give a YAML file"),
    ("bogus-experiment", "no experiment 'bogus-experiment'"),
])
def test_compare_refuses_a_bad_experiment_file(cli, bad_files, name, fragment):
    arg = bad_files.get(name, name)
    assert_one_line_error(cli("compare", arg), 2, fragment)


@pytest.mark.parametrize("text, fragment", [
    ("name: x\nruns: [\n", "is not valid YAML"),  # was a yaml.ParserError traceback
    ("- a\n- b\n", "an experiment file is a mapping"),  # was an AttributeError traceback
    ("name: x\nruns: [1, 2]\n", "'runs' must be a list of mappings"),
])
def test_compare_refuses_malformed_yaml(cli, tmp_path, text, fragment):
    (tmp_path / "exp.yaml").write_text(text)
    line = assert_one_line_error(cli("compare", tmp_path / "exp.yaml", "--out", tmp_path / "out"), 2, fragment)
    assert "exp.yaml" in line and not (tmp_path / "out").exists()


def test_analyze_checks_paths_and_the_context(cli, tiny_ckpt, bad_files, tmp_path):
    assert_one_line_error(cli("analyze", "grads", tiny_ckpt, "--out", bad_files["a-directory"]), 2,
                          "is a directory; give a file name")
    assert_one_line_error(cli("analyze", "grads", tiny_ckpt, "--seq-len", "100000"), 2,
                          "--seq-len 100000 exceeds the model context 64")
    assert_one_line_error(cli("analyze", "grads", bad_files["a-directory"]), 2, "no config.json")
