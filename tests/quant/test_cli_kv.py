"""`fusedkv eval --kv-bits` and `fusedkv prune` through the real command line."""

import json

import pytest
import torch

from fusedkv.cli import main
from fusedkv.data import prepare_dataset
from fusedkv.model import FusedKVForCausalLM
from tests.conftest import tiny_model
from tests.test_cli import save_tokenizer

TEXT = "ROMEO: what light through yonder window breaks? It is the east, and Juliet is the sun.\n" * 60


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    save_tokenizer(path, 300)
    tiny_model("fusedkv", vocab_size=300).save_pretrained(path)
    text = path.parent / "text.txt"
    text.write_text(TEXT)
    prepare_dataset(str(text), path.parent / "ds", tokenizer=str(path))
    return path


def _eval(checkpoint, tmp_path, *extra):
    out = tmp_path / f"eval{len(extra)}.json"
    argv = ["eval", str(checkpoint), "--val", str(checkpoint.parent / "ds"), "--seq-len", "40", "--max-batches", "1",
            "--tasks", "none", "--json", str(out), *extra]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_eval_kv_bits_scores_through_the_quantised_cache(checkpoint, tmp_path):
    fp = _eval(checkpoint, tmp_path)
    q4 = _eval(checkpoint, tmp_path, "--kv-bits", "4", "--kv-group", "4", "--kv-residual", "8")
    q2 = _eval(checkpoint, tmp_path, "--kv-bits", "2", "--kv-group", "4", "--kv-residual", "8")
    assert q4["kv_cache"] == {"kivi_bits": 4, "group": 4, "residual": 8}
    assert fp["val_loss"] != q4["val_loss"] != q2["val_loss"]
    assert abs(q4["val_loss"] - fp["val_loss"]) < abs(q2["val_loss"] - fp["val_loss"])


@pytest.mark.parametrize("extra, message", [
    (["--kv-bits", "3"], "supports 2 or 4 bits"),
    (["--kv-bits", "4", "--kv-group", "5"], "does not divide the head dimension 16"),
    (["--kv-bits", "4", "--kv-group", "4", "--kv-residual", "6"], "multiple of the group size"),
])
def test_eval_kv_errors_are_one_line(checkpoint, extra, message, capsys):
    assert main(["eval", str(checkpoint), "--tasks", "none", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.slow
def test_prune_through_the_cli(checkpoint, tmp_path, capsys):
    out = tmp_path / "pruned"
    assert main(["prune", str(checkpoint), "--out", str(out), "--nm", "2:4", "--calib-seqs", "2",
                 "--calib-len", "16"]) == 0
    assert "model.layers.3.mlp.down_proj.weight" in capsys.readouterr().out
    w = FusedKVForCausalLM.from_pretrained(out).model.layers[0].self_attn.q_proj.weight
    assert (w == 0).float().mean().item() == 0.5 and torch.isfinite(w).all()
    with pytest.raises(SystemExit) as refused:  # out of range: refused while parsing, exit 2
        main(["prune", str(checkpoint), "--out", str(tmp_path / "x"), "--sparsity", "2"])
    assert refused.value.code == 2


def _held_and_new(err):
    new = int(err.split(" new tokens")[0].rsplit(" ", 1)[1])
    return int(err.split("KV cache held ")[1].split(" bytes")[0].replace(",", "")), new


def test_generate_kv_bits_reports_the_quantised_cache_bytes(checkpoint, capsys):
    from transformers import AutoTokenizer

    from fusedkv.config import FusedKVConfig
    from fusedkv.quant import kivi_cache_nbytes

    argv = ["generate", str(checkpoint), "--prompt", "ROMEO: what", "--max-new-tokens", "20", "--greedy"]
    assert main(argv) == 0
    full_held, _ = _held_and_new(capsys.readouterr().err)
    assert main([*argv, "--kv-bits", "4", "--kv-group", "4", "--kv-residual", "8"]) == 0
    held, new = _held_and_new(capsys.readouterr().err)
    prompt_len = len(AutoTokenizer.from_pretrained(checkpoint)("ROMEO: what").input_ids)
    cfg = FusedKVConfig.from_pretrained(checkpoint)
    assert held == kivi_cache_nbytes(cfg, prompt_len + new - 1, 1, 4, 4, 8) < full_held
    assert main([*argv, "--kv-bits", "3"]) == 2
    assert "supports 2 or 4 bits" in capsys.readouterr().err
