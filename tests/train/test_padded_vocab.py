"""Padded vocabularies: a model whose embedding table is larger than its tokenizer (Llama, Qwen2.5 and
DeepSeek checkpoints round vocab_size up) trains on data of the smaller tokenizer; the padded rows are never
a target. Only a tokenizer larger than the model is refused (tests/train/test_trainer.py)."""

import json
import math

import pytest
from train_helpers import nano_config

from fusedkv import FusedKVForCausalLM
from fusedkv.train import train
from fusedkv.train.data import plan_data


def test_tokenizer_smaller_than_vocab_size_is_accepted(tmp_path, nano_data, corpus_file):
    assert json.loads((nano_data / "meta.json").read_text())["vocab_size"] == 512
    # prepared data of the 512-token tokenizer, and raw text with that tokenizer, both fit a 576-row model
    assert plan_data(nano_config(tmp_path / "run", nano_data, vocab_size=576), 576)[1] == nano_data
    raw = nano_config(tmp_path / "raw", corpus_file, vocab_size=576, tokenizer=str(nano_data / "tokenizer"),
                      data_dir=str(tmp_path / "prepared"))
    assert plan_data(raw, 576)[2] is not None
    with pytest.raises(ValueError, match="vocabulary of 512 tokens but the model's vocab_size is 511"):
        plan_data(nano_config(tmp_path / "run", nano_data, vocab_size=511), 511)


@pytest.mark.slow
def test_tokenizer_smaller_than_vocab_size_trains(tmp_path, nano_data):
    result = train(nano_config(tmp_path / "run", nano_data, vocab_size=576, max_steps=2))
    assert result["steps"] == 2 and math.isfinite(result["val_loss"])
    model = FusedKVForCausalLM.from_pretrained(result["checkpoint"])
    assert model.config.vocab_size == 576 and model.get_input_embeddings().weight.shape[0] == 576
