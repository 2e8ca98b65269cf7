"""Token data and model must share a tokenizer: `fusedkv eval --val` refuses shards whose metadata records
another tokenizer's hash, before the model loads (#5). The real CLI in a child process."""

import shutil

import pytest

from tests.reliability.conftest import assert_one_line_error


@pytest.fixture(scope="module")
def other_tokenizer_ckpt(tmp_path_factory, tiny_ckpt):
    """The tiny model with a tokenizer of the same size trained on other text: ids mean other strings."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("other-tok-ckpt")
    for f in tiny_ckpt.iterdir():
        if not f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy2(f, path / f.name)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["In the beginning God created the heaven and the earth"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|pad|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>").save_pretrained(path)
    return path


@pytest.mark.parametrize("which", ["dir", "bin"])
def test_val_made_with_another_tokenizer_is_refused(cli, other_tokenizer_ckpt, tiny_val, which):
    """Was (#5): scored without a word (exit 0, a loss over ids that mean other text)."""
    val = tiny_val if which == "dir" else tiny_val / "val.bin"
    r = cli("eval", other_tokenizer_ckpt, "--val", val, "--tasks", "none", "--max-batches", "1")
    assert_one_line_error(r, 2, f"--val {val} was tokenised with another tokenizer", str(other_tokenizer_ckpt))
    assert "validation loss" not in r.stdout


def test_val_made_with_the_same_tokenizer_is_scored(cli, tiny_ckpt, tiny_val):
    r = cli("eval", tiny_ckpt, "--val", tiny_val / "val.bin", "--tasks", "none", "--max-batches", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "validation loss" in r.stdout and "warning" not in r.stderr
