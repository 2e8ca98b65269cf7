"""`tie_word_embeddings: true` in config.json with the checkpoint's own `lm_head.weight` (issue 41, defect 3):
transformers then keeps the head untied when its values differ from the embeddings (it warns), and ties it
when they are equal. The import does the same, so its logits are transformers' in both cases."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from fusedkv.convert import convert_checkpoint

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, initializer_range=0.1)


@pytest.mark.parametrize("head", ["own", "equal"])
def test_a_tied_config_with_its_own_head_converts_as_transformers_loads_it(tmp_path, head):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).save_pretrained(tmp_path / "src")
    state = load_file(tmp_path / "src" / "model.safetensors")
    assert "lm_head.weight" not in state  # save_pretrained stores a tied head once
    embed = state["model.embed_tokens.weight"]
    state["lm_head.weight"] = torch.randn_like(embed) if head == "own" else embed.clone()
    save_file(state, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    reference = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "src").eval()
    ours = convert_checkpoint(tmp_path / "src", tmp_path / "out").eval()
    assert ours.config.tie_word_embeddings is (head == "equal")
    assert torch.equal(ours.lm_head.weight, state["lm_head.weight"])
    assert torch.equal(ours.model.embed_tokens.weight, embed)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        assert (ours(ids).logits - reference(ids).logits).abs().max() < 1e-5
