"""`fusedkv prune`: a checkpoint in, an ordinary pruned checkpoint out, with the measured sparsity."""

import argparse

import pytest
import torch

from fusedkv.model import FusedKVForCausalLM
from fusedkv.prune import command
from tests.conftest import tiny_model
from tests.test_cli import save_tokenizer


def _run(argv):
    parser = argparse.ArgumentParser()
    command.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    save_tokenizer(path, 300)
    tiny_model("fusedkv", vocab_size=300).save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("extra, per_row", [(["--sparsity", "0.5"], None), (["--nm", "2:4"], 4)])
def test_prune_writes_a_checkpoint_that_loads_and_runs(checkpoint, tmp_path, capsys, extra, per_row):
    out = tmp_path / "pruned"
    _run(["prune", str(checkpoint), "--out", str(out), "--calib-seqs", "4", "--calib-len", "32", *extra])
    printed = capsys.readouterr().out
    assert "model.layers.0.self_attn.k_proj.weight" in printed and "0.5000" in printed
    pruned = FusedKVForCausalLM.from_pretrained(out).eval()
    original = FusedKVForCausalLM.from_pretrained(checkpoint).eval()
    w = pruned.model.layers[2].mlp.down_proj.weight
    assert (w == 0).float().mean().item() == 0.5
    if per_row:
        assert bool(((w == 0).reshape(w.shape[0], -1, per_row).sum(-1) == 2).all())
    kept = w != 0
    assert torch.equal(w[kept], original.model.layers[2].mlp.down_proj.weight[kept])  # survivors untouched
    ids = torch.randint(1, 300, (1, 12))
    with torch.no_grad():
        logits = pruned(ids).logits
    assert torch.isfinite(logits).all() and not torch.allclose(logits, original(ids).logits)
    assert (out / "tokenizer.json").exists()


@pytest.mark.parametrize("extra, message", [
    (["--sparsity", "1.2"], "--sparsity"),
    (["--nm", "3"], "N:M"),
    (["--nm", "2:4", "--sparsity", "0.3"], "contradicts"),
    (["--calib-len", "4096"], "model context"),
    (["--calib-seqs", "0"], "--calib-seqs"),
])
def test_bad_flags_are_one_line_errors(checkpoint, tmp_path, extra, message, capsys):
    from fusedkv.cli import main

    try:
        code = main(["prune", str(checkpoint), "--out", str(tmp_path / "x"), *extra])
    except SystemExit as e:  # refused while parsing the flags
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]  # (transformers' loading bar aside)
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in err
