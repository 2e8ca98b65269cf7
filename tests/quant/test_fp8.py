"""The fp8 (e4m3) KV cache used to score a model as an engine's 8-bit cache would serve it."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from fusedkv import FusedKVConfig, FusedKVForCausalLM
from fusedkv.quant.fp8 import E4M3_MAX, FP8Cache, fp8_round_trip
from fusedkv.quant.scoring import DecodeScorer


def test_round_trip_is_e4m3_with_scale_and_saturates():
    x = torch.tensor([0.0, 1.0, 1.0625, 3.3, -17.0, 1000.0, -1e6], dtype=torch.float64)
    got = fp8_round_trip(x, scale=2.0)
    want = (x / 2).clamp(-E4M3_MAX, E4M3_MAX).float().to(torch.float8_e4m3fn).double() * 2
    assert torch.equal(got, want)
    assert got[-2] == 2 * E4M3_MAX and got[-1] == -2 * E4M3_MAX  # saturated, never NaN
    assert torch.isfinite(fp8_round_trip(torch.tensor([1e30]))).all()


def _model(plan: str) -> FusedKVForCausalLM:
    torch.manual_seed(0)
    cfg = FusedKVConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=97, kv_sharing=plan)
    return FusedKVForCausalLM(cfg).eval()


@pytest.mark.parametrize("plan", ["vanilla", "fusedkv", "fusedkv-lite"])
def test_cache_stores_the_rounded_kv_of_the_storage_layers(plan):
    model = _model(plan)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain, fp8 = DynamicCache(config=model.config), FP8Cache(model.config)
        model(ids, cache=plain, use_cache=True)
        model(ids, cache=fp8, use_cache=True)
    # Layer 1 sees the same input either way; later layers see outputs of attention over rounded K/V, so
    # theirs differ, but every stored value is an e4m3 value (rounding it again changes nothing).
    assert torch.equal(fp8.layers[0].keys, fp8_round_trip(plain.layers[0].keys))
    assert torch.equal(fp8.layers[0].values, fp8_round_trip(plain.layers[0].values))
    assert not torch.equal(fp8.layers[0].keys, plain.layers[0].keys)
    for i in model.config.plan.storage_layers:
        for t in (fp8.layers[i].keys, fp8.layers[i].values):
            assert torch.equal(t, fp8_round_trip(t))
    assert fp8.get_seq_length() == 9


@pytest.mark.parametrize("plan", ["vanilla", "fusedkv"])
def test_scoring_through_fp8_is_close_to_but_not_the_full_forward(plan):
    model = _model(plan)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits
        dec = DecodeScorer(model, FP8Cache)(ids).logits
    gap = (full - dec).abs().max().item()
    assert 0 < gap < 0.1  # rounded (e4m3 keeps 3 mantissa bits), yet the same model
