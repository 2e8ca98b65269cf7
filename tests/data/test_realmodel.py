"""The real-model texts: `stdlib` never holds a held-out text, `heldout:KIND` prepares into validation only."""

from __future__ import annotations

import pytest

from fusedkv.data import prepare_dataset, resolve_source, train_bpe_tokenizer
from fusedkv.data import realmodel as R


@pytest.fixture
def fake_stdlib(tmp_path, monkeypatch):
    """A small standard library: kept modules, excluded folders, and one module that copies held-out code."""
    root = tmp_path / "lib"
    code = "\n".join(f"def function_number_{i}(argument_one, argument_two):  # held out {i}" for i in range(40))
    files = {"os.py": "import sys\n" + "\n".join(f"x_{i} = 'a line of ordinary library code number {i}'"
                                                    for i in range(60)),
             "json/decoder.py": "\n".join(f"def decode_{i}(s):  return s.strip()  # decoder line {i:04d}"
                                          for i in range(30)),
             "email/message.py": code, "pydoc_data/topics.py": "topics = {}", "test/test_os.py": "assert True",
             "idlelib/idle_test/test_x.py": "assert True", "site-packages/pkg/mod.py": "x = 1",
             "copier.py": code + "\n" + "\n".join(f"y_{i} = 'something different enough here {i}'" for i in range(10))}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    monkeypatch.setattr(R, "STDLIB", root)
    monkeypatch.setattr(R, "HELDOUT_EMAIL", root / "email")
    return root


def test_stdlib_leaves_out_the_held_out_texts_tests_and_packages(fake_stdlib):
    src = resolve_source("stdlib")
    names = [n for n, _ in src.iter_named()]
    assert names == ["stdlib/json/decoder.py", "stdlib/os.py"]
    assert src.dropped == ["copier.py"]  # 40 of its 50 long lines are the held-out email code
    held = set().union(*(R._long_lines(t) for k in ("prose", "code") for _, t in R.iter_heldout(k)))
    assert all(not (R._long_lines(t) & held) for t in src)


def test_a_held_out_spec_prepares_into_validation_only(fake_stdlib, tmp_path, small_text):
    tok = train_bpe_tokenizer([small_text], 300, tmp_path / "tok")
    ds = prepare_dataset("heldout:code", tmp_path / "code", tokenizer=tok, num_proc=1)
    assert len(ds.train) == 0 and ds.meta["val"]["num_documents"] == 1 and len(ds.val) > 100
    prose = prepare_dataset("heldout:prose", tmp_path / "prose", tokenizer=tok, num_proc=1)
    from pydoc_data.topics import topics

    assert prose.meta["val"]["num_documents"] == len([t for t in topics.values() if t.strip()])
    with pytest.raises(ValueError, match="heldout:prose, heldout:code, heldout:builtin"):
        resolve_source("heldout:poetry")
    paths = R.write_heldout(tmp_path / "files")
    assert paths["code"].read_text() == (fake_stdlib / "email" / "message.py").read_text()


@pytest.mark.slow
def test_the_real_stdlib_corpus_shares_no_long_line_with_the_held_out_texts():
    src = R.StdlibSource()
    held = set().union(*(R._long_lines(t) for k in ("prose", "code") for _, t in R.iter_heldout(k)))
    n, shared = 0, 0
    for name, text in src.iter_named():
        assert not name.startswith(("stdlib/email/", "stdlib/pydoc_data/", "stdlib/test/"))
        lines = R._long_lines(text)
        n, shared = n + len(lines), shared + len(lines & held)
    assert n > 50_000 and shared <= R.MAX_SHARED * n  # 90k long lines in CPython 3.11's library
