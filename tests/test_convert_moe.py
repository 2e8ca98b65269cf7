"""Import of transformers' Qwen3-MoE checkpoints: logit parity and equal greedy generation for the
vanilla plan (per-expert weights as save_pretrained writes them, stacked into fused expert tensors),
the same aux loss, and a trainable half-cache model for the other plans."""

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from fusedkv import FusedKVForCausalLM
from fusedkv.convert import convert_qwen3


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=101, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                         mlp_only_layers=[1], num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=256, router_aux_loss_coef=0.01,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("qwen3moe")
    model.save_pretrained(path)
    return path, model


def test_vanilla_conversion_matches_transformers_qwen3_moe(qwen3_moe_dir, tmp_path):
    src, reference = qwen3_moe_dir
    convert_qwen3(src, tmp_path, kv_sharing="vanilla")
    ours = FusedKVForCausalLM.from_pretrained(tmp_path).eval()
    assert ours.config.num_experts == 6 and ours.config.mlp_only_layers == [1] and ours.config.norm_topk_prob
    assert [type(layer.mlp).__name__ for layer in ours.model.layers] == ["SparseMoE", "SwiGLU", "SparseMoE",
                                                                         "SparseMoE"]
    ids = torch.randint(0, 101, (2, 40))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        a, b = ours(ids, labels=ids, use_cache=False), reference(ids, labels=ids)
        assert (a.logits - b.logits).abs().max() < 1e-4
        # the same load-balancing loss, with padding excluded as transformers excludes it
        a = ours(ids, attention_mask=mask, use_cache=False, output_router_logits=True)
        b = reference(ids, attention_mask=mask, output_router_logits=True)
        assert (a.aux_loss - b.aux_loss).abs() < 1e-5
        gen_a = ours.generate(ids[:1, :10], max_new_tokens=10, do_sample=False)
        gen_b = reference.generate(ids[:1, :10], max_new_tokens=10, do_sample=False)
    assert torch.equal(gen_a, gen_b)


def test_half_cache_conversion_keeps_experts(qwen3_moe_dir, tmp_path):
    src, reference = qwen3_moe_dir
    model = convert_qwen3(src, tmp_path, kv_sharing="fusedkv")
    ref = reference.state_dict()  # transformers keeps fused 3-D experts in memory: the same layout as ours
    for name, tensor in model.state_dict().items():
        if ".fusion." not in name:
            assert torch.equal(tensor, ref[name]), name
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (6, 64, 64)
    assert "model.layers.3.self_attn.k_proj.weight" not in model.state_dict()


def test_missing_expert_weights_are_reported(qwen3_moe_dir, tmp_path):
    from fusedkv.convert import from_qwen3_state, load_state_dict, qwen3_to_fusedkv_config

    src, _ = qwen3_moe_dir
    import json

    config = qwen3_to_fusedkv_config(json.loads((src / "config.json").read_text()), "vanilla")
    state = load_state_dict(src)
    del state["model.layers.2.mlp.experts.5.up_proj.weight"]
    with pytest.raises(ValueError, match="expert weights missing"):
        from_qwen3_state(state, config)
