"""The KIVI group size follows the model (#17): README's `fusedkv generate RUN/final --kv-bits 4` failed on
the model `fusedkv train` makes by default (head_dim 48 is not a multiple of the old fixed G = 32)."""

import shutil

import pytest

from fusedkv.quant import default_group_size
from tests.reliability.conftest import assert_one_line_error


@pytest.fixture(scope="module")
def default_train_model(tmp_path_factory, tiny_ckpt):
    """A random model of exactly the shape `fusedkv train` (no flags) trains, with the tiny tokenizer."""
    from fusedkv import FusedKVForCausalLM
    from fusedkv.train import TrainConfig

    config = TrainConfig().model_config()
    assert config.head_dim == 48  # the case of the report
    path = tmp_path_factory.mktemp("default-train-model")
    FusedKVForCausalLM(config).save_pretrained(path)
    for f in tiny_ckpt.glob("tokenizer*"):
        shutil.copy2(f, path / f.name)
    return path


def test_the_default_group_divides_the_head_dimension_and_the_residual():
    assert default_group_size(128) == default_group_size(64) == 32  # KIVI's G whenever it fits
    assert (default_group_size(48), default_group_size(40), default_group_size(96, 64)) == (16, 8, 32)
    for head_dim in range(2, 300, 2):
        g = default_group_size(head_dim)
        assert head_dim % g == 0 and 128 % g == 0


@pytest.mark.parametrize("bits", ["4", "2"])
def test_readme_example_runs_on_the_default_train_model(cli, default_train_model, bits):
    r = cli("generate", default_train_model, "--kv-bits", bits, "--max-new-tokens", "4", "--greedy", "--prompt",
            "ROMEO:")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ROMEO" in r.stdout and "KV cache held" in r.stderr


def test_eval_kv_bits_on_the_default_train_model(cli, default_train_model, tiny_val):
    r = cli("eval", default_train_model, "--kv-bits", "4", "--val", tiny_val, "--tasks", "none", "--max-batches",
            "1", "--seq-len", "16", "--batch-size", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "KIVI 4-bit KV cache (G=16, R=128)" in r.stdout


def test_an_explicit_group_that_does_not_fit_is_still_refused(cli, default_train_model):
    r = cli("generate", default_train_model, "--kv-bits", "4", "--kv-group", "32", "--max-new-tokens", "2")
    assert_one_line_error(r, 2, "KIVI group size 32 does not divide the head dimension 48")
