"""Fixtures for the training tests: a small prepared dataset (once per session) and nano configs.

Everything runs single-threaded: on a 2-core machine shared with other jobs, OpenMP threads that
spin against each other make torch several times slower (and timing-dependent)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fusedkv.data import prepare_dataset, read_builtin_text


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True, scope="session")
def _data_cache(tmp_path_factory):
    """Runs that prepare data by default write to $FUSEDKV_DATA_DIR: keep that out of the repo."""
    mp = pytest.MonkeyPatch()
    mp.setenv("FUSEDKV_DATA_DIR", str(tmp_path_factory.mktemp("data-cache")))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory) -> Path:
    """~200 KB of the built-in text as one file (a single document: the val split is its tail)."""
    p = tmp_path_factory.mktemp("corpus") / "small.txt"
    p.write_text(read_builtin_text(limit_chars=200_000))
    return p


@pytest.fixture(scope="session")
def nano_data(tmp_path_factory, corpus_file) -> Path:
    """A prepared dataset (512-token BPE) that every nano run shares."""
    out = tmp_path_factory.mktemp("data") / "nano-512"
    prepare_dataset(str(corpus_file), out, vocab_size=512, num_proc=1)
    return out
