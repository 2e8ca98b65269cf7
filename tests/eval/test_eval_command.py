"""`fusedkv eval` end to end on a tiny random FusedKV checkpoint: validation loss, text perplexity,
the shipped lm-eval tasks and a RULER task, with a JSON report."""

import json
import math

import pytest
import torch

from fusedkv import FusedKVConfig, FusedKVForCausalLM
from fusedkv.cli import main
from fusedkv.data import prepare_dataset


@pytest.mark.slow
def test_eval_command_end_to_end(tmp_path, tokenizer, corpus_text):
    torch.manual_seed(0)
    cfg = FusedKVConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, max_position_embeddings=1024, kv_sharing="fusedkv",
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    ckpt = tmp_path / "ckpt"
    FusedKVForCausalLM(cfg).save_pretrained(ckpt)
    tokenizer.save_pretrained(ckpt)
    (tmp_path / "corpus.txt").write_text(corpus_text)
    (tmp_path / "text.txt").write_text(corpus_text[:4000])  # a few dozen windows are enough for a perplexity
    data = prepare_dataset(str(tmp_path / "corpus.txt"), tmp_path / "data", tokenizer=str(ckpt), num_proc=1)
    report = tmp_path / "report.json"
    argv = ["eval", str(ckpt), "--val", str(tmp_path / "data"), "--seq-len", "64", "--max-batches", "3",
            "--text", str(tmp_path / "text.txt"), "--tasks", "local", "--limit", "3", "--ruler",
            "--ruler-lengths", "512", "--ruler-tasks", "niah_single_1", "--ruler-samples", "2", "--json", str(report)]
    assert main(argv) == 0
    out = json.loads(report.read_text())
    assert abs(out["val_ppl"] - math.exp(out["val_loss"])) < 1e-6 * out["val_ppl"]
    assert out["val_loss"] > math.log(len(tokenizer)) - 1.5  # an untrained model is near uniform
    assert out["text_ppl"] > 1 and "fkv_sciq_mini" in out["tasks"]
    assert 0 <= out["ruler"]["overall"] <= 100
    assert data.val.vocab_size == len(tokenizer)


def test_eval_refuses_ruler_longer_than_the_context(tmp_path, tokenizer, capsys):
    cfg = FusedKVConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, max_position_embeddings=64)
    FusedKVForCausalLM(cfg).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "t.txt").write_text("hello world " * 50)
    assert main(["eval", str(tmp_path), "--val", str(tmp_path / "nope.bin"), "--tasks", "none"]) == 2
    assert "no such file" in capsys.readouterr().err
