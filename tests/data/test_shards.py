"""prepare_dataset / ShardWriter / TokenShard: dtype, split, determinism, idempotency, corruption."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from fusedkv.data import (
    ShardWriter,
    TokenShard,
    dtype_for_vocab,
    load_prepared_dataset,
    load_tokenizer,
    prepare_dataset,
)


def split_docs(tokens: np.ndarray, eos: int) -> list[tuple[int, ...]]:
    """Documents of a shard (each ends with EOS)."""
    ends = np.flatnonzero(tokens == eos)
    docs, start = [], 0
    for e in ends:
        docs.append(tuple(tokens[start:e].tolist()))
        start = e + 1
    assert start == len(tokens), "every document must be followed by EOS"
    return docs


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, small_corpus_dir):
    out = tmp_path_factory.mktemp("prep") / "ds"
    ds = prepare_dataset(str(small_corpus_dir), out, vocab_size=512, val_fraction=0.25, num_proc=1, seed=0)
    return ds


def test_prepare_writes_shards(prepared, small_corpus_dir):
    ds = prepared
    out = ds.out_dir
    for name in ("train.bin", "val.bin", "train.meta.json", "val.meta.json", "meta.json", "tokenizer"):
        assert (out / name).exists(), name
    assert ds.train.dtype == np.uint16 and ds.val.dtype == np.uint16
    assert ds.vocab_size == 512 and ds.meta["dtype"] == "uint16"
    assert ds.meta["val_split"] == "documents"
    n_docs = len(list(small_corpus_dir.glob("*.txt")))
    assert ds.train.meta["num_documents"] + ds.val.meta["num_documents"] == n_docs
    assert ds.val.meta["num_documents"] >= 1 and ds.train.meta["num_documents"] >= 1
    assert int(ds.train.tokens.max()) < 512
    tok = load_tokenizer(ds.tokenizer_dir)
    assert ds.eos_id == tok.eos_token_id
    # The shards decode back to the original documents, each followed by EOS.
    train_docs = split_docs(np.asarray(ds.train.tokens), ds.eos_id)
    val_docs = split_docs(np.asarray(ds.val.tokens), ds.eos_id)
    assert len(train_docs) == ds.train.meta["num_documents"]
    originals = {p.read_text() for p in small_corpus_dir.glob("*.txt")}
    assert {tok.decode(list(d)) for d in train_docs + val_docs} == originals
    # Validation holds out whole documents, disjoint from training.
    assert not set(train_docs) & set(val_docs)
    assert {f"doc{i:02d}.txt" for i in range(n_docs)} >= set(ds.meta["val_documents"])


def test_num_proc_2_is_byte_identical_and_rerun_is_idempotent(prepared, small_corpus_dir, tmp_path):
    out2 = tmp_path / "ds2"
    ds2 = prepare_dataset(str(small_corpus_dir), out2, tokenizer=prepared.tokenizer_dir,
                          val_fraction=0.25, num_proc=2, seed=0)
    for name in ("train.bin", "val.bin"):
        assert (prepared.out_dir / name).read_bytes() == (out2 / name).read_bytes()
    mtime = os.stat(out2 / "train.bin").st_mtime_ns
    ds3 = prepare_dataset(str(small_corpus_dir), out2, tokenizer=prepared.tokenizer_dir,
                          val_fraction=0.25, num_proc=2, seed=0)
    assert os.stat(out2 / "train.bin").st_mtime_ns == mtime  # reused, not rewritten
    assert ds3.meta == ds2.meta
    # A different request (other seed -> other held-out documents) rebuilds.
    ds4 = prepare_dataset(str(small_corpus_dir), out2, tokenizer=prepared.tokenizer_dir,
                          val_fraction=0.25, num_proc=1, seed=1)
    assert ds4.meta["request"]["seed"] == 1
    assert ds4.meta["val_documents"] != ds2.meta["val_documents"]


def test_damaged_output_is_rebuilt(prepared, small_corpus_dir, tmp_path):
    out = tmp_path / "ds"
    kw = dict(tokenizer=prepared.tokenizer_dir, val_fraction=0.25, num_proc=1)
    prepare_dataset(str(small_corpus_dir), out, **kw)
    good = (out / "train.bin").read_bytes()
    with open(out / "train.bin", "r+b") as f:  # as if a copy was cut short
        f.truncate(len(good) // 2)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_prepared_dataset(out)
    prepare_dataset(str(small_corpus_dir), out, **kw)
    assert (out / "train.bin").read_bytes() == good
    assert not [p for p in out.iterdir() if ".tmp" in p.name]


def test_single_file_falls_back_to_token_tail(small_text, tmp_path, prepared):
    f = tmp_path / "one.txt"
    f.write_text(small_text[:20_000])
    ds = prepare_dataset(str(f), tmp_path / "ds", tokenizer=prepared.tokenizer_dir, val_fraction=0.1,
                         num_proc=1)
    assert ds.meta["val_split"] == "token_tail"
    total = ds.train.num_tokens + ds.val.num_tokens
    assert ds.val.num_tokens == int(np.ceil(total * 0.1))
    tok = load_tokenizer(ds.tokenizer_dir)
    joined = np.concatenate([ds.train.tokens, ds.val.tokens]).tolist()
    assert joined[-1] == ds.eos_id and tok.decode(joined[:-1]) == small_text[:20_000]


def test_prepare_errors(tmp_path, small_corpus_dir, prepared):
    with pytest.raises(ValueError, match="does not exist"):
        prepare_dataset(str(tmp_path / "missing"), tmp_path / "o1")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("   \n")
    with pytest.raises(ValueError, match="no non-empty documents"):
        prepare_dataset(str(empty), tmp_path / "o2", vocab_size=512, num_proc=1)
    assert not (tmp_path / "o2" / "meta.json").exists()
    with pytest.raises(ValueError, match="not found"):
        prepare_dataset(str(small_corpus_dir), tmp_path / "o3", tokenizer=prepared.tokenizer_dir,
                        val_docs=["doc00.txt", "nonexistent.txt"], num_proc=1)
    ds = prepare_dataset(str(small_corpus_dir), tmp_path / "o4", tokenizer=prepared.tokenizer_dir,
                         val_docs=["doc03.txt"], num_proc=1)
    assert ds.meta["val_documents"] == ["doc03.txt"] and ds.val.meta["num_documents"] == 1


def test_shard_writer_dtype_and_token_shard(tmp_path):
    assert dtype_for_vocab(65535) == np.uint16 and dtype_for_vocab(65536) == np.uint32
    w = ShardWriter(tmp_path / "big.bin", vocab_size=100_000, eos_id=99_999)
    w.write(np.array([1, 70_000, 99_999]), documents=1)
    meta = w.close()
    assert meta["dtype"] == "uint32" and meta["num_tokens"] == 3
    shard = TokenShard(tmp_path / "big.bin")
    assert shard.tokens.dtype == np.uint32 and shard.tokens.tolist() == [1, 70_000, 99_999]
    assert len(shard) == 3 and shard.eos_id == 99_999 and shard.vocab_size == 100_000
    with pytest.raises(ValueError, match="out of range"):
        ShardWriter(tmp_path / "x.bin", vocab_size=10, eos_id=0).write(np.array([10]))


def test_token_shard_rejects_truncated_and_unlabelled_files(tmp_path):
    w = ShardWriter(tmp_path / "s.bin", vocab_size=512, eos_id=0)
    w.write(np.arange(100) % 512, documents=1)
    w.close()
    assert len(TokenShard(tmp_path / "s.bin")) == 100
    with open(tmp_path / "s.bin", "r+b") as f:
        f.truncate(150)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        TokenShard(tmp_path / "s.bin")
    (tmp_path / "s.meta.json").unlink()
    with pytest.raises(ValueError, match="no metadata file"):
        TokenShard(tmp_path / "s.bin")
    (tmp_path / "bad.bin").write_bytes(b"\0\0")
    (tmp_path / "bad.meta.json").write_text(json.dumps({"dtype": "uint16"}))
    with pytest.raises(ValueError, match="corrupt metadata"):
        TokenShard(tmp_path / "bad.bin")
    with pytest.raises(ValueError, match="does not exist"):
        TokenShard(tmp_path / "none.bin")


@pytest.mark.manual
def test_builtin_full_prepare(tmp_path):
    """The default run: whole builtin corpus, 8k vocab (~15-30 s on 2 cores)."""
    ds = prepare_dataset("builtin", tmp_path / "builtin", vocab_size=8192, num_proc=2)
    total = ds.train.num_tokens + ds.val.num_tokens
    assert ds.val.num_tokens / total >= 0.03
    assert ds.train.meta["num_documents"] == 101 and ds.val.meta["num_documents"] == 7
    assert ds.train.dtype == np.uint16
