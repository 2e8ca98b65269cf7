"""Import reads one shard at a time: each shard's tensors are copied into the model and freed before the next
shard is read (memory: the model plus one shard), also when a MoE layer's experts span shards."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import fusedkv.convert.core as core
from fusedkv.convert import convert_checkpoint


@pytest.mark.slow
def test_each_shard_is_freed_before_the_next_is_read(tmp_path, monkeypatch):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2)
    reference = LlamaForCausalLM(cfg).eval()
    reference.save_pretrained(tmp_path / "src", max_shard_size="20KB")
    alive: list[weakref.ref] = []
    live_at_read: list[int] = []
    read = core.read_shard

    def tracked(path):
        gc.collect()
        live_at_read.append(sum(r() is not None for r in alive))
        shard = read(path)
        alive.extend(weakref.ref(t) for t in shard.values())
        return shard

    monkeypatch.setattr(core, "read_shard", tracked)
    model = convert_checkpoint(tmp_path / "src", tmp_path / "dst").eval()
    assert len(live_at_read) == len(list((tmp_path / "src").glob("*.safetensors"))) > 3
    assert live_at_read == [0] * len(live_at_read)
    ids = torch.randint(0, 64, (1, 10))
    with torch.no_grad():
        assert (model(ids).logits - reference(ids).logits).abs().max() < 1e-5


def test_moe_experts_split_across_shards(tmp_path):
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=8,
                         num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         head_dim=16)
    reference = Qwen3MoeForCausalLM(cfg).eval()
    reference.save_pretrained(tmp_path / "src", max_shard_size="8KB")
    assert len(list((tmp_path / "src").glob("*.safetensors"))) > 4
    model = convert_checkpoint(tmp_path / "src", tmp_path / "dst").eval()
    ids = torch.randint(0, 64, (1, 10))
    with torch.no_grad():
        assert (model(ids).logits - reference(ids).logits).abs().max() < 1e-5
