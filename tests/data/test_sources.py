"""Document sources: builtin corpus, txt/dir/jsonl/parquet files, HF spec parsing and errors."""

from __future__ import annotations

import json
import lzma
import time

import pytest

from fusedkv.data import (
    BUILTIN_VAL_DOCS,
    BuiltinSource,
    HFSource,
    JsonlSource,
    ParquetSource,
    TextSource,
    iter_documents,
    resolve_source,
)


@pytest.fixture(scope="module")
def builtin_docs():
    return list(BuiltinSource().iter_named())


@pytest.mark.slow
def test_builtin_corpus(builtin_docs):
    names = [n for n, _ in builtin_docs]
    assert len(builtin_docs) == 42 + 66  # 42 Shakespeare works + 66 books of the Bible
    assert sum(n.startswith("shakespeare/") for n in names) == 42
    assert [n for n in names if n.startswith("kjv/")][:3] == ["kjv/Genesis", "kjv/Exodus", "kjv/Leviticus"]
    assert names[-1] == "kjv/Revelation"
    assert len(set(names)) == len(names)
    assert all(t.strip() for _, t in builtin_docs)
    texts = dict(builtin_docs)
    assert texts["kjv/Genesis"].startswith("Genesis 1\n")
    assert "Revelation 22" in texts["kjv/Revelation"] and "Genesis" not in texts["kjv/Exodus"][:50]
    assert "HAMLET" in texts["shakespeare/hamlet"][:200]
    # Splitting the Bible into books loses nothing: all 1189 chapters, every character.
    from fusedkv.data.sources import _KJV_HEADING, KJV_FILE

    with lzma.open(KJV_FILE, "rt") as f:
        whole = f.read()
    kjv = [t for n, t in builtin_docs if n.startswith("kjv/")]
    assert sum(len(_KJV_HEADING.findall(t)) for t in kjv) == 1189
    assert abs(sum(len(t) for t in kjv) - len(whole)) < 3 * 66


@pytest.mark.slow  # reads and splits the whole packaged corpus (test_builtin_corpus's fixture)
def test_builtin_val_docs_exist_and_are_big_enough(builtin_docs):
    sizes = {n: len(t) for n, t in builtin_docs}
    assert set(BUILTIN_VAL_DOCS) <= set(sizes)
    share = sum(sizes[n] for n in BUILTIN_VAL_DOCS) / sum(sizes.values())
    assert 0.03 <= share <= 0.1


def test_resolve_specs(tmp_path):
    assert isinstance(resolve_source("builtin"), BuiltinSource)
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "a.parquet").write_bytes(b"")
    assert isinstance(resolve_source(tmp_path / "a.txt"), TextSource)
    assert isinstance(resolve_source(str(tmp_path)), TextSource)
    assert isinstance(resolve_source(tmp_path / "a.jsonl"), JsonlSource)
    assert isinstance(resolve_source(tmp_path / "a.parquet"), ParquetSource)
    hf = resolve_source("hf:HuggingFaceFW/fineweb-edu:sample-10BT:train")
    assert isinstance(hf, HFSource)
    assert (hf.name, hf.config, hf.split) == ("HuggingFaceFW/fineweb-edu", "sample-10BT", "train")
    hf = resolve_source("hf:stas/tiny")
    assert (hf.config, hf.split) == (None, "train")
    with pytest.raises(ValueError, match="expected 'hf:<name>"):
        resolve_source("hf:")


def test_text_file_and_directory(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text("To be, or not to be.\n\nThat is the question.\n")
    assert list(iter_documents(f)) == [f.read_text()]  # one document per file
    d = tmp_path / "dir"
    (d / "sub").mkdir(parents=True)
    (d / "b.txt").write_text("second")
    (d / "a.txt").write_text("first")
    (d / "sub" / "c.txt").write_text("third")
    (d / "ignored.md").write_text("not a txt")
    (d / "empty.txt").write_text("  \n")  # whitespace-only documents are skipped
    assert list(iter_documents(d)) == ["first", "second", "third"]
    assert [n for n, _ in TextSource(d).iter_named()] == ["a.txt", "b.txt", "sub/c.txt"]


def test_jsonl(tmp_path):
    p = tmp_path / "x.jsonl"
    rows = [{"text": "alpha", "id": 1}, {"text": ""}, {"text": "beta"}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert list(iter_documents(p)) == ["alpha", "beta"]
    q = tmp_path / "y.jsonl"
    q.write_text(json.dumps({"content": "gamma"}) + "\n")
    assert list(iter_documents(q, text_field="content")) == ["gamma"]
    with pytest.raises(ValueError, match="no field 'text'.*text_field"):
        list(iter_documents(q))


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "x.parquet"
    pq.write_table(pa.table({"text": ["one", None, "two", "three"], "n": [1, 2, 3, 4]}), p)
    assert list(iter_documents(p)) == ["one", "two", "three"]
    with pytest.raises(ValueError, match="no column 'body'"):
        list(iter_documents(p, text_field="body"))


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"does not exist\. Use 'builtin'"):
        resolve_source(tmp_path / "nope.txt")


def test_empty_corpus_is_a_clear_error(tmp_path):
    (tmp_path / "a.txt").write_text("\n\n   \n")
    (tmp_path / "b.txt").write_text("")
    src = resolve_source(tmp_path)
    with pytest.raises(ValueError, match="contains no non-empty documents"):
        list(src)
    p = tmp_path / "e.jsonl"
    p.write_text('{"text": "  "}\n')
    with pytest.raises(ValueError, match="no non-empty documents"):
        list(iter_documents(p))
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match="contains no .txt files"):
        resolve_source(empty_dir)


def test_hf_source_offline_fails_fast(monkeypatch):
    # The hub is unreachable here; both the offline mode and the reachability probe must give a
    # clear ValueError within seconds rather than minutes of retries.
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    t0 = time.time()
    with pytest.raises(ValueError, match="could not open Hugging Face dataset"):
        next(iter(resolve_source("hf:someone/surely-not-cached-dataset:cfg:train")))
    assert time.time() - t0 < 20


def test_hf_source_unreachable_endpoint(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # port 9: refused
    with pytest.raises(ValueError, match="unreachable"):
        next(iter(resolve_source("hf:someone/dataset")))
