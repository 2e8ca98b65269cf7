"""Byte-level BPE training and loading through transformers.AutoTokenizer."""

from __future__ import annotations

import pytest

from fusedkv.data import EOS_TOKEN, PAD_TOKEN, load_tokenizer, tokenizer_sha256, train_bpe_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, small_text):
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    docs = small_text.split("\n\n\n")
    train_bpe_tokenizer(docs, vocab_size=512, out_dir=out)
    return out


def test_trained_tokenizer_loads_with_autotokenizer(tok_dir, small_text):
    from transformers import AutoTokenizer

    assert (tok_dir / "tokenizer.json").is_file()
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    assert len(tok) == 512
    assert tok.eos_token == EOS_TOKEN and tok.bos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN
    assert tok.eos_token_id == tok.bos_token_id == 0 and tok.pad_token_id == 1
    # Byte-level: any text round-trips exactly, including text never seen in training.
    for text in (small_text[:3000], "  odd   spacing , punctuation ; ünïcödé ✓ 中文\n\tend"):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
        assert max(ids) < 512
    # Merges were learned: real English compresses well below one token per character.
    prose = small_text[-3000:]
    assert len(tok(prose, add_special_tokens=False)["input_ids"]) < 0.6 * len(prose)
    assert tok.convert_tokens_to_ids(EOS_TOKEN) == 0
    assert EOS_TOKEN in tok.decode(tok(f"a{EOS_TOKEN}b")["input_ids"])


def test_load_tokenizer(tok_dir, tmp_path):
    tok = load_tokenizer(tok_dir)
    assert load_tokenizer(tok) is tok
    assert tokenizer_sha256(tok) == tokenizer_sha256(load_tokenizer(str(tok_dir)))
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "missing" / "tokenizer")
    with pytest.raises(ValueError, match="holds no tokenizer"):
        load_tokenizer(tmp_path)


def test_vocab_too_small(tmp_path):
    with pytest.raises(ValueError, match="too small"):
        train_bpe_tokenizer(["abc"], vocab_size=100, out_dir=tmp_path / "t")
