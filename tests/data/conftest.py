"""Shared fixtures for the data tests: small real text, cut from the packaged corpus once per session."""

from __future__ import annotations

import pytest

from fusedkv.data import read_builtin_text


@pytest.fixture(scope="session")
def small_text() -> str:
    # ~120 KB of Shakespeare: enough for a 512-token BPE, small enough to keep the suite fast.
    return read_builtin_text(limit_chars=120_000)


@pytest.fixture(scope="session")
def small_corpus_dir(tmp_path_factory, small_text):
    """A directory of 24 .txt documents (~5 KB each) of real text."""
    d = tmp_path_factory.mktemp("corpus")
    n = 24
    size = len(small_text) // n
    for i in range(n):
        (d / f"doc{i:02d}.txt").write_text(small_text[i * size:(i + 1) * size])
    return d
