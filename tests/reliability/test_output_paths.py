"""The class guard for every path a command writes (issue 41, defect 2 and its class): each output flag of
every subcommand is typed (`argtypes.output_file` / `output_dir`: a directory given for a file, or a file for
a directory, is refused while parsing), each file is written through the one atomic writer
(`fusedkv.utils.write_atomic`: exactly the path given, whole or not at all), and every `--overwrite` has a
test showing that the old result is replaced only after the new one exists. Cheap: parsers, source text and
a few small files, no model."""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest

from fusedkv import argtypes, cli
from fusedkv.utils import save_figure, write_atomic, write_json_atomic
from tests.reliability.conftest import assert_one_line_error

REPO = Path(__file__).resolve().parents[2]
# A flag or positional whose name says it is written to.
OUTPUT_NAME = re.compile(r"^(--)?(out|output|dst|save|json|json_path)$|-plot$|^--plot$|-json$|-out$|-dir$")
# Names that match but are read, not written: (command, flag) -> why.
READ_ONLY = {
    ("compare", "--record"): "the committed record of finished runs, read to make the table",
    ("train", "--data-dir"): "where prepared data is cached (written by fusedkv.data through temporary files)",
}


def _walk(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, (*prefix, name))
        else:
            yield prefix, action


def _outputs():
    found = []
    for prefix, action in _walk(cli.build_parser()):
        names = action.option_strings or [action.dest]
        if any(OUTPUT_NAME.search(n) for n in names):
            found.append((" ".join(prefix), names[-1] if action.option_strings else action.dest, action))
    return found


def test_the_walk_finds_the_known_outputs():
    """The guard below sees the flags it is meant to guard (a pattern that matched nothing would pass)."""
    seen = {(c, n) for c, n, _ in _outputs()}
    for want in (("train", "--out"), ("uptrain", "out"), ("eval", "--retrieval-plot"), ("eval", "--json"),
                 ("bench", "--json"), ("bench", "--plot"), ("prune", "--out"), ("compare", "--out"),
                 ("convert", "dst")):
        assert want in seen, (want, sorted(seen))


def test_every_output_flag_is_typed():
    untyped = [f"{c} {n}" for c, n, a in _outputs()
               if (c.split()[0], n) not in READ_ONLY and getattr(a.type, "fusedkv_output", None) not in ("file", "dir")]
    assert not untyped, f"output flags without argtypes.output_file / output_dir: {untyped}"


# ---- every file through the one writer ----------------------------------------------------------------------
WRITES = re.compile(r"\.savefig\(|\.write_text\(|\.write_bytes\(|json\.dump\(|\bopen\([^)]*[\"'][wax]b?[\"']")
# Raw writes that are not a command's output file, each with why it is safe: (module, count).
ALLOWED = {
    "fusedkv/utils.py": (2, "the atomic writer itself"),
    "fusedkv/model_dirs.py": (2, "the manifest (a temporary file, fsynced, then os.replace); a lock file opened "
                                 "to test whether a temporary's writer is alive (nothing written)"),
    "fusedkv/model/modeling.py": (1, "save_pretrained's helper module, inside a model directory that callers "
                                      "write whole (write_directory_atomically, replace_dir)"),
    "fusedkv/train/full_checkpoint.py": (2, "inside the checkpoint's temporary directory, renamed when complete"),
    "fusedkv/train/sharded_checkpoint.py": (3, "inside the checkpoint's temporary directory, renamed when complete"),
    "fusedkv/train/metrics.py": (2, "metrics.csv, a log rewritten from the checkpointed history and appended"),
    "fusedkv/data/shards.py": (2, "token shards: temporary files, renamed by ShardWriter.close"),
    "fusedkv/eval/harness.py": (1, "lm-eval task files in a temporary task directory"),
    "fusedkv/speed/llamacpp.py": (1, "the marker written last into an extracted converter directory"),
    "fusedkv/convert/sources.py": (2, "a GGUF import's config and marker, inside a directory written whole "
                                      "(a temporary directory, write_directory_atomically)"),
    "fusedkv/train/teacher_cache.py": (1, "the top-K store's sparse files, created full-size under a temporary "
                                         "name and renamed; windows are filled in place and marked done after"),
    "fusedkv/serving/offline.py": (1, "a tool the tests run in vLLM's environment, not a fusedkv command"),
}


def test_no_module_writes_a_file_but_through_the_atomic_writer():
    found: dict[str, list[str]] = {}
    for path in sorted((REPO / "fusedkv").rglob("*.py")):
        rel = str(path.relative_to(REPO))
        for line in path.read_text().splitlines():
            if WRITES.search(line) and not line.lstrip().startswith("#"):
                found.setdefault(rel, []).append(line.strip())
    wrong = {rel: lines for rel, lines in found.items() if len(lines) != ALLOWED.get(rel, (0,))[0]}
    assert not wrong, ("write through fusedkv.utils.write_atomic (write_text_atomic, write_json_atomic, "
                       f"save_figure), or explain the exception in ALLOWED: {wrong}")


# ---- --overwrite replaces only after the new result exists --------------------------------------------------
# Every command with --overwrite, and the tests that show a failing new run leaves the old result whole.
OVERWRITE_TESTS = {
    "train": ["test_train_reliability.py::test_overwrite_touches_nothing_until_the_new_run_is_known_to_start"],
    "convert": ["test_convert_safety.py::test_failed_conversion_with_overwrite_leaves_the_destination_as_it_was"],
    "uptrain": ["test_uptrain_reliability.py::test_overwrite_with_bad_input_keeps_the_finished_run",
                "test_uptrain_reliability.py::test_overwrite_keeps_the_finished_run_when_the_conversion_fails"],
    "prune": ["test_prune_reliability.py::test_out_holding_another_model_is_refused_before_any_work",
              "test_prune_reliability.py::test_overwrite_replaces_the_model_whole"],
}


def test_every_overwrite_has_a_test_that_the_old_result_survives():
    commands = {" ".join(p) for p, a in _walk(cli.build_parser()) if "--overwrite" in a.option_strings}
    assert commands == set(OVERWRITE_TESTS), "a new --overwrite needs its test here"
    for tests in OVERWRITE_TESTS.values():
        for node in tests:
            module, name = node.split("::")
            assert callable(getattr(importlib.import_module(f"tests.reliability.{module[:-3]}"), name)), node


def test_the_writer_replaces_only_once_the_new_file_is_complete(tmp_path):
    path = tmp_path / "report.json"
    write_json_atomic(path, {"old": 1})

    def fails(tmp):
        tmp.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_atomic(path, fails)
    assert path.read_text() == '{\n "old": 1\n}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]  # no temporary left
    (tmp_path / "a-dir").mkdir()
    with pytest.raises(IsADirectoryError):
        write_json_atomic(tmp_path / "a-dir", {})


def test_a_figure_is_written_at_exactly_the_path_given(tmp_path):
    """matplotlib alone writes `plot.png` for `plot` (and leaves an old `plot` as it was)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure()
    for name in ("plot", "plot.png", "plot.svg"):
        assert save_figure(fig, tmp_path / name) == tmp_path / name
    plt.close(fig)
    assert (tmp_path / "plot").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "plot.svg").read_text().lstrip().startswith("<?xml")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot", "plot.png", "plot.svg"]


def test_output_types_refuse_the_wrong_kind_of_path(tmp_path):
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(argparse.ArgumentTypeError, match="is a directory; give a file name, e.g. "):
        argtypes.output_file("retrieval.png")(str(tmp_path))
    with pytest.raises(argparse.ArgumentTypeError, match="is a file; give a directory"):
        argtypes.output_dir(str(tmp_path / "file.txt"))
    assert argtypes.output_file("x.png")(str(tmp_path / "new.png")) == str(tmp_path / "new.png")


def test_eval_retrieval_plot_into_a_directory_is_refused(cli, tiny_ckpt, tmp_path):
    """Defect 2: `--retrieval-plot DIR` wrote DIR.png over an existing file and printed 'wrote DIR'."""
    plots = tmp_path / "plots"
    plots.mkdir()
    (tmp_path / "plots.png").write_text("an unrelated file")
    r = cli("eval", tiny_ckpt, "--retrieval", "--retrieval-plot", plots, "--tasks", "none")
    assert_one_line_error(r, 2, "--retrieval-plot", "is a directory", str(plots / "retrieval.png"))
    assert (tmp_path / "plots.png").read_text() == "an unrelated file"
    assert list(plots.iterdir()) == []
