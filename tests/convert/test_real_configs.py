"""The complete config.json files real models of every supported family ship with (tests/convert/real_configs/,
as their publishers wrote them: legacy spellings, metadata and all), and the one transformers writes after a
GGUF load. Each is accepted at its published size (every field classified: tests/convert/test_fields.py),
and, shrunk to tiny dimensions by `shrink` (shapes only: every other field as published), its random-weight
checkpoint converts to transformers' logits (vanilla, float32, within 1e-5, a left-padded batch longer than
any window)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from fusedkv.convert import UnsupportedField, convert_checkpoint, family_for

CONFIGS = Path(__file__).parent / "real_configs"
FILES = sorted(p.name for p in CONFIGS.glob("*.json"))
VOCAB, WINDOW = 128, 8


def published(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def shrink(hf: dict) -> dict:
    """`hf` at tiny dimensions: sizes, head and expert counts, windows and token ids made small; every other field
    (RoPE scaling, activations, soft-capping, layer patterns, metadata) left as published."""
    small = dict(hf, vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                 initializer_range=0.1, num_hidden_layers=6 if hf.get("sliding_window_pattern") else 4)
    kv = hf.get("num_key_value_heads", hf["num_attention_heads"])
    small["num_key_value_heads"] = 4 if kv == hf["num_attention_heads"] else min(kv, 2)
    if "head_dim" in hf:
        small["head_dim"] = 16
    for ids in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(hf.get(ids), int):
            small[ids] = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}[ids]
        elif isinstance(hf.get(ids), list):
            small[ids] = [2, 3][: len(hf[ids])]
    if hf.get("sliding_window") and hf["sliding_window"] < hf["max_position_embeddings"]:
        small["sliding_window"] = WINDOW
    if "max_window_layers" in hf:
        small["max_window_layers"] = min(hf["max_window_layers"], small["num_hidden_layers"])
    if "query_pre_attn_scalar" in hf:
        small["query_pre_attn_scalar"] = 16
    if "num_experts" in hf:  # Qwen3-MoE
        small.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    if "n_routed_experts" in hf:  # DeepSeek: MLA and DeepSeekMoE
        small.update(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, kv_lora_rank=16,
                     q_lora_rank=hf["q_lora_rank"] and 24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                     n_group=min(hf["n_group"], 2), topk_group=1, first_k_dense_replace=1)
    return small


def test_every_family_has_a_published_config():
    types = {published(name)["model_type"] for name in FILES}
    assert types == {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "deepseek_v2",
                     "deepseek_v3"}
    assert "smollm2-135m-instruct-gguf-load.json" in FILES  # what transformers saves after a GGUF load


@pytest.mark.parametrize("name", FILES)
def test_the_published_config_is_accepted_at_its_size(name):
    hf = published(name)
    if "quantization_config" in hf and hf["quantization_config"]["quant_method"] == "fp8":  # DeepSeek-V3's fp8
        with pytest.raises(UnsupportedField, match="quantization_config.*dequantise the weights"):
            family_for(hf).to_config(hf, "vanilla")
        hf.pop("quantization_config")  # as after DeepSeek's own fp8 -> bf16 cast
    config = family_for(hf).to_config(hf, "vanilla")
    assert config.num_hidden_layers == hf["num_hidden_layers"] and config.vocab_size == hf["vocab_size"]
    assert family_for(hf).to_config(hf, "fusedkv").kv_cache_fraction(4096) < config.kv_cache_fraction(4096)


@pytest.mark.parametrize("name", FILES)
def test_a_tiny_checkpoint_of_the_published_config_converts_to_transformers_logits(name, tmp_path):
    hf = shrink(published(name))
    if (hf.get("quantization_config") or {}).get("quant_method") == "fp8":
        hf.pop("quantization_config")  # random float weights stand in for the dequantised checkpoint
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(hf))
    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(src)
    config._attn_implementation = "eager"
    reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    reference.save_pretrained(src)
    (src / "config.json").write_text(json.dumps(hf, indent=2))  # the published file, not transformers' rewrite
    ours = convert_checkpoint(src, tmp_path / "out").eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (2, 19), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :6], mask[1, :6] = 0, 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = reference(ids, attention_mask=mask, position_ids=positions).logits
        got = ours(ids, attention_mask=mask).logits
    real = mask.bool()
    assert (got[real] - want[real]).abs().max() < 1e-5
