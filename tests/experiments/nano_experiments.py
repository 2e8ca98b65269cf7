"""Helpers shared by the experiment tests (a module of its own: conftest files are not importable)."""

from __future__ import annotations

from pathlib import Path

from fusedkv.data import read_builtin_text


def nano_corpus(tmp_path: Path) -> Path:
    """150k characters of the built-in corpus: enough for a nano BPE and a few steps."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(read_builtin_text(limit_chars=150_000))
    return corpus


def nano_experiment(tmp_path: Path, base: str, rest: str) -> Path:
    """An experiment file over `nano_corpus`: `base` adds training fields to the nano preset's,
    `rest` is the YAML that follows (runs, seeds, evaluate)."""
    spec_file = tmp_path / "exp.yaml"
    spec_file.write_text(f"name: nano\ndescription: nano runs\n"
                         f"base: {{preset: nano, data: {nano_corpus(tmp_path)}, {base}}}\n{rest}")
    return spec_file
