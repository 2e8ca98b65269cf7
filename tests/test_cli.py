"""The command line: help text, the plans table, generate/convert round trip, clear errors."""

import pytest

from fusedkv.cli import main
from fusedkv.commands.plans import plans_table
from tests import _cli as cli_process
from tests.conftest import tiny_model


def run_cli(*args):
    """`fusedkv ARGS` in a child process (forked from one that imported fusedkv once: tests/_cli.py)."""
    return cli_process.fusedkv(*args, timeout=300)


def test_help_lists_subcommands(capsys):
    # In this process: argparse's --help is the same code here as in a child, which would cost an interpreter
    # that imports torch (the tests of a real child process: test_generation.py, tests/reliability/).
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("plans", "generate", "convert", "bench"):
        assert cmd in out


def test_plans_table_reproduces_spec_ratios():
    table = plans_table(16, 16, None, 128, 8192, 2)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines()[2:]}
    assert rows["vanilla"][3:5] == ["1", "1"]
    assert rows["gqa"][3:5] == ["0.5", "0.5"]
    assert rows["fusedkv-lite"][3:5] == ["0.5", "1"]
    assert rows["fusedkv"][3:5] == ["0.5", "1.5"]


def save_tokenizer(path, vocab_size):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["ROMEO: what light through yonder window breaks"] * 20,
                            trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|pad|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>").save_pretrained(path)


def test_generate_from_checkpoint(tmp_path, capsys):
    save_tokenizer(tmp_path, 300)
    tiny_model("fusedkv", vocab_size=300).save_pretrained(tmp_path)
    assert main(["generate", str(tmp_path), "--prompt", "ROMEO:", "--max-new-tokens", "5", "--greedy"]) == 0
    assert "KV cache held" in capsys.readouterr().err


@pytest.mark.parametrize("head", [[], ["--head-weights", "int4"]])
def test_generate_int4_weights(tmp_path, capsys, head):
    """--weights int4 (LM head at int8 by default; --head-weights int4: an LM head of 300 outputs, padded to
    whole blocks) decodes through the native step where the kernels are built."""
    from fusedkv.kernels import native

    save_tokenizer(tmp_path, 300)
    tiny_model("fusedkv", vocab_size=300).save_pretrained(tmp_path)
    argv = ["generate", str(tmp_path), "--prompt", "ROMEO:", "--max-new-tokens", "5", "--greedy", "--weights", "int4",
            *head]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "KV cache held" in err and ("native decode step" in err) == native.available()


@pytest.mark.parametrize("argv, message", [
    (["generate", "/no/such/dir"], "does not exist"),
    (["convert", "/no/such/dir", "/tmp/x"], "no config.json"),
])
def test_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_generate_refuses_a_tokenizer_larger_than_the_vocab(tmp_path, capsys):
    save_tokenizer(tmp_path, 300)
    tiny_model("fusedkv").save_pretrained(tmp_path)  # vocab_size 97
    assert main(["generate", str(tmp_path)]) == 2
    assert "vocab_size=97" in capsys.readouterr().err
