"""Sliding-window hybrids (paper App. A.6): windowed attention on every path equals transformers' Qwen3,
incremental decode equals the full forward for every plan (the paper's +W and +WF sharing), prompts
longer than the window included, and window layers' caches stay bounded at W - 1 tokens."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from fusedkv import FusedKVConfig, FusedKVForCausalLM
from fusedkv.cache import StaticKVCache, kv_cache_nbytes
from fusedkv.convert import from_qwen3_state
from fusedkv.engine import select_runtime
from fusedkv.generation import generate
from fusedkv.plan import FULL, SLIDING
from tests.conftest import randomize_fusion, tiered
from tests.model.test_decode import incremental_logits, padded_batch

WINDOW = 5
TYPES = [SLIDING, SLIDING, SLIDING, FULL] * 2  # the paper's hybrid: three window layers, then one full
SHAPE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
             head_dim=16, max_position_embeddings=128)


def hybrid_model(plan: str, shared=None, seed: int = 0, **overrides) -> FusedKVForCausalLM:
    torch.manual_seed(seed)
    cfg = FusedKVConfig(**SHAPE, kv_sharing=plan, layer_types=TYPES, sliding_window=WINDOW,
                        shared_attention_types=shared, pad_token_id=0, **overrides)
    model = FusedKVForCausalLM(cfg).eval()
    randomize_fusion(model, seed)
    return model


def test_vanilla_hybrid_matches_transformers_qwen3_with_sliding_window():
    torch.manual_seed(0)
    qcfg = Qwen3Config(**SHAPE, num_key_value_heads=4, layer_types=TYPES, sliding_window=WINDOW,
                       use_sliding_window=True, max_window_layers=0, tie_word_embeddings=False)
    hf = Qwen3ForCausalLM(qcfg).eval()
    ours = from_qwen3_state(hf.state_dict(), FusedKVConfig(**SHAPE, kv_sharing="vanilla", layer_types=TYPES,
                                                           sliding_window=WINDOW))
    full = from_qwen3_state(hf.state_dict(), FusedKVConfig(**SHAPE, kv_sharing="vanilla"))
    ids = torch.randint(1, 97, (2, 3 * WINDOW))
    with torch.no_grad():
        ref = hf(ids).logits
        for path in ("materialized", "factored"):
            select_runtime(ours, path)
            assert (ours(ids).logits - ref).abs().max() < 1e-4, path
        assert (full(ids).logits - ref).abs().max() > 1e-3  # the window really restricts attention
        assert torch.equal(generate(ours, ids[:1, :9], 8).tokens,
                           hf.generate(ids[:1, :9], max_new_tokens=8, do_sample=False, pad_token_id=0))


PLANS = [("vanilla", None), ("cla", None), ("yoco", None), ("fusedkv-lite", [SLIDING]), ("fusedkv-lite", None),
         ("fusedkv", [SLIDING]), ("fusedkv", None)]  # shared [SLIDING] is the paper's +W, None (both) +WF


# The fast tier: every plan on the default path over a prompt longer than the window; every path and prompt for
# two plans (vanilla, the paper's FusedKV +W). The full suite: every combination.
@pytest.mark.parametrize("path, prompt_len, plan, shared", tiered(
    [(path, n, plan, shared) for path in ("auto", "materialized", "factored") for n in (2, 3 * WINDOW)
     for plan, shared in PLANS],
    lambda path, n, plan, shared: (path == "auto" and n > WINDOW) or (plan, shared) in PLANS[:1] + PLANS[5:6],
    lambda path, n, plan, shared: f"{path}-{n}-{plan}-{'W' if shared else 'WF'}"))
def test_incremental_decode_matches_full_forward(plan, shared, prompt_len, path):
    model = hybrid_model(plan, shared)
    select_runtime(model, path)
    ids, mask, width = padded_batch(prompt_len)
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        for cache in (None, StaticKVCache(model.config, 2, ids.shape[1])):
            steps, _ = incremental_logits(model, ids, mask, width, cache=cache)
            got = torch.cat(steps, dim=1)
            real = mask.bool()
            assert (got - full)[real].abs().max() < 1e-4


@pytest.mark.parametrize("plan, shared", [("vanilla", None), ("fusedkv", [SLIDING]), ("fusedkv", None)])
def test_window_caches_hold_only_the_last_tokens(plan, shared):
    model = hybrid_model(plan, shared)
    ids = torch.randint(1, 97, (1, 4 * WINDOW))
    plan_ = model.config.plan
    per_token = 2 * model.config.num_key_value_heads * model.config.head_dim * 4  # K and V, fp32
    for new in (1, 10, 30):
        total = ids.shape[1] + new
        expected = sum(per_token * (min(total - 1, WINDOW - 1) if plan_.layers[i].attention_type == SLIDING
                                    else total - 1) for i in plan_.storage_layers)
        with torch.no_grad():
            out = model(ids, use_cache=True)
            cache = out.cache
            for _ in range(new - 1):
                cache = model(ids[:, -1:], cache=cache, use_cache=True).cache
        assert kv_cache_nbytes(cache) == expected  # bounded however long the generation runs
    static = StaticKVCache(model.config, 1, 128)
    window_layers = [i for i in plan_.storage_layers if plan_.layers[i].attention_type == SLIDING]
    assert all(static.keys[i].shape[2] == WINDOW - 1 for i in window_layers)
    assert all(static.keys[i].shape[2] == 128 for i in plan_.storage_layers if i not in window_layers)


def test_bad_window_configs_are_refused():
    with pytest.raises(ValueError, match="sliding_window"):
        FusedKVConfig(**SHAPE, layer_types=TYPES, sliding_window=1000)
    with pytest.raises(ValueError, match="sliding_window"):
        FusedKVConfig(**SHAPE, layer_types=TYPES, sliding_window=None)


def test_cache_fractions_of_the_papers_hybrid():
    # 16 layers in groups of three window + one full, window 512, context 8k (paper App. A.6): full
    # attention 100%, the hybrid 29.7%; FusedKV +W (window layers shared) 27.3%, +WF (both) 14.8%
    # (6 window + 2 full storage layers; the paper's 12.9% would be 1 window + 2 full).
    types = [SLIDING, SLIDING, SLIDING, FULL] * 4

    def fraction(plan, shared=None):
        cfg = FusedKVConfig(num_hidden_layers=16, hidden_size=256, num_attention_heads=4, layer_types=types,
                            sliding_window=512, max_position_embeddings=8192, kv_sharing=plan,
                            shared_attention_types=shared)
        return round(cfg.kv_cache_fraction(8192), 3)

    assert fraction("vanilla") == 0.297
    assert fraction("fusedkv", [SLIDING]) == 0.273
    assert fraction("fusedkv") == 0.148
    assert FusedKVConfig(**SHAPE, kv_sharing="fusedkv").kv_cache_fraction() == 0.5  # no window: context-free


@pytest.mark.parametrize("plan, shared", [("fusedkv", None), ("fusedkv-lite", [SLIDING]), ("yoco", None)])
def test_generate_equals_greedy_over_full_forwards(plan, shared):
    # generate(): static window caches and a prefill that skips the upper layers for all but the last
    # prompt position, against re-running the whole sequence each step without any cache.
    model = hybrid_model(plan, shared)
    ids = torch.randint(1, 97, (1, 3 * WINDOW))
    seq = ids
    with torch.no_grad():
        for _ in range(8):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(generate(model, ids, 8).tokens, seq)


def test_the_reading_that_gives_the_papers_12_9_percent():
    # 12.9% at 8k/512 is exactly 2 full + 1 window storage layers (16896 / 131072): every window layer
    # but the first reads window layer 1, the upper full layers fuse full layers 4 and 8. As a custom
    # source map (the named +WF plan keeps all six lower window layers: 14.8%).
    types = [SLIDING, SLIDING, SLIDING, FULL] * 4
    window_readers = [{"layers": [a, b], "k": 1, "v": 1} for a, b in ((2, 3), (5, 7), (9, 11), (13, 15))]
    full_readers = [{"layers": i, "k": [4, 8], "v": [4, 8]} for i in (12, 16)]
    cfg = FusedKVConfig(num_hidden_layers=16, hidden_size=256, num_attention_heads=4, layer_types=types,
                        sliding_window=512, max_position_embeddings=8192, kv_sharing="custom",
                        kv_source_map=window_readers + full_readers)
    assert cfg.plan.storage_layers == (0, 3, 7) and round(cfg.kv_cache_fraction(8192), 3) == 0.129
