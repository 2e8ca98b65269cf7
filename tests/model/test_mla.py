"""Multi-head latent attention: parity with transformers' DeepSeek-V3 attention, absorbed decode equal to
the expanded forward, incremental decode equal to the full forward for every plan that applies, RoPE
shift invariance of fused RoPE keys, the cache holding only latents and RoPE keys, clear errors."""

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from fusedkv import FusedKVForCausalLM
from fusedkv.cache import StaticKVCache, kv_cache_nbytes
from fusedkv.engine import select_runtime
from tests.conftest import tiered, tiny_config, tiny_model
from tests.model.test_decode import incremental_logits, padded_batch
from tests.model.test_model import shifted_logits

# 4 heads of (16 nope + 8 rope) query/key channels and 16 value channels; a 24-dim latent.
MLA = dict(kv_lora_rank=24, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, head_dim=None)
MLA_PLANS = {
    "vanilla": dict(kv_sharing="vanilla"),
    "cla": dict(kv_sharing="cla"),
    "yoco": dict(kv_sharing="yoco"),
    "fusedkv": dict(kv_sharing="fusedkv"),
    "fusedkv-dense": dict(kv_sharing="fusedkv-dense"),
    "single-source-scaling": dict(kv_sharing="custom", kv_source_map=[
        {"layers": [3, 4], "k": 2, "v": 2, "k_fusion": "channel", "v_fusion": "channel"}]),
    "full-rank-query": dict(kv_sharing="fusedkv", q_lora_rank=None),
}


def mla_model(plan="fusedkv", dtype=torch.float32, **overrides):
    return tiny_model(plan, dtype=dtype, **{**MLA, **MLA_PLANS[plan], **overrides})


# ---- parity with transformers' DeepSeek-V3 ---------------------------------------------------------
def deepseek_rope_rows(rope_dim: int) -> torch.Tensor:
    """DeepSeek checkpoints lay RoPE channels out as interleaved pairs (x0, x1), (x2, x3), ...; transformers'
    `apply_rotary_pos_emb_interleave` rotates them as the rotate-half pairs of (x0, x2, ..., x1, x3, ...)."""
    return torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))


def copy_deepseek_weights(reference, ours, interleaved: bool):
    cfg = ours.config
    state = dict(reference.state_dict())
    if interleaved:
        perm = deepseek_rope_rows(cfg.qk_rope_head_dim)
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        head_perm = torch.cat((torch.arange(cfg.qk_nope_head_dim), cfg.qk_nope_head_dim + perm))
        q_rows = torch.cat([h * qk + head_perm for h in range(cfg.num_attention_heads)])
        kv_rows = torch.cat((torch.arange(cfg.kv_lora_rank), cfg.kv_lora_rank + perm))
        for name in list(state):
            if name.endswith(("q_b_proj.weight", "self_attn.q_proj.weight")):
                state[name] = state[name][q_rows]
            elif "kv_a_proj_with_mqa" in name:
                state[name] = state[name][kv_rows]
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)


@pytest.mark.parametrize("q_lora_rank, interleaved", [(32, True), (None, False)])
def test_vanilla_mla_matches_transformers_deepseek_v3(q_lora_rank, interleaved):
    torch.manual_seed(0)
    ref_cfg = DeepseekV3Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=q_lora_rank, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, first_k_dense_replace=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        rope_interleave=interleaved, max_position_embeddings=128, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, pad_token_id=0)
    reference = DeepseekV3ForCausalLM(ref_cfg).eval()
    ours = tiny_model("vanilla", **{**MLA, "q_lora_rank": q_lora_rank}).eval()
    copy_deepseek_weights(reference, ours, interleaved)
    ids = torch.randint(1, 97, (2, 40))
    with torch.no_grad():
        for path in ("materialized", "factored"):
            select_runtime(ours, path)
            assert (ours(ids, use_cache=False).logits - reference(ids).logits).abs().max() < 1e-4, path
        select_runtime(ours, "auto")
        a = ours.generate(ids[:1, :10], max_new_tokens=10, do_sample=False)
        b = reference.generate(ids[:1, :10], max_new_tokens=10, do_sample=False)
    assert torch.equal(a, b)


# ---- absorbed == expanded, decode == full forward ---------------------------------------------------
@pytest.mark.parametrize("plan", list(MLA_PLANS))
def test_absorbed_attention_equals_expanded(plan):
    model = mla_model(plan, dtype=torch.float64)
    ids, mask, _ = padded_batch(12)
    with torch.no_grad():
        select_runtime(model, "materialized")
        expanded = model(ids, attention_mask=mask, use_cache=False).logits
        unpadded = model(ids[:, 3:], use_cache=False).logits  # the causal-flag path
        select_runtime(model, "factored")
        assert (model(ids, attention_mask=mask, use_cache=False).logits - expanded).abs().max() < 1e-10
        assert (model(ids[:, 3:], use_cache=False).logits - unpadded).abs().max() < 1e-10


# The fast tier: every plan and path at one prompt length, the other lengths for vanilla and FusedKV.
@pytest.mark.parametrize("plan, path, prompt_len", tiered(
    [(plan, path, n) for plan in MLA_PLANS for path in ("auto", "materialized", "factored") for n in (1, 9, 33)],
    lambda plan, path, n: n == 9 or plan in ("vanilla", "fusedkv")))
def test_mla_incremental_decode_matches_full_forward(plan, path, prompt_len):
    model = mla_model(plan)
    select_runtime(model, path)
    ids, mask, width = padded_batch(prompt_len)
    with torch.no_grad():
        select_runtime(model, "materialized")
        full = model(ids, attention_mask=mask, use_cache=False).logits
        select_runtime(model, path)
        steps, _ = incremental_logits(model, ids, mask, width)
        skipped, _ = incremental_logits(model, ids, mask, width, keep_last=1)
    valid = mask[:, :width].bool()
    assert (steps[0] - full[:, :width])[valid].abs().max() < 1e-4
    assert (skipped[0][:, 0] - full[:, width - 1]).abs().max() < 1e-4
    for k, (step, skip) in enumerate(zip(steps[1:], skipped[1:])):
        assert (step[:, 0] - full[:, width + k]).abs().max() < 1e-4
        assert (skip[:, 0] - full[:, width + k]).abs().max() < 1e-4


def test_absorbed_decode_never_expands_the_latent():
    """kv_b_proj (the up-projection to per-head K/V) never runs as a layer in absorbed decode: its weight
    is only folded into the query and the output."""
    model = mla_model("fusedkv")
    select_runtime(model)  # the engine's implementations: absorbed for short blocks
    calls = []
    for layer in model.model.layers:
        layer.self_attn.kv_b_proj.register_forward_hook(lambda m, i, o: calls.append(i[0].shape))
    ids, mask, width = padded_batch(20)
    with torch.no_grad():
        out = model(ids[:, :width], attention_mask=mask[:, :width], use_cache=True)  # long prefill: expanded
        assert len(calls) == 4
        calls.clear()
        for t in range(width, ids.shape[1]):
            out = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=out.cache, use_cache=True)
    assert calls == []


def test_static_cache_holds_latents():
    model = mla_model("fusedkv")
    ids, mask, width = padded_batch(7)
    cache = StaticKVCache(model.config, batch_size=2, max_len=64)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        steps, cache = incremental_logits(model, ids, mask, width, keep_last=1, cache=cache)
    for k, step in enumerate(steps[1:]):
        assert (step[:, 0] - full[:, width + k]).abs().max() < 1e-4
    assert kv_cache_nbytes(cache) == 2 * (24 + 8) * 2 * 64 * 4  # storage layers x (r + d_R) x B x S x fp32


# ---- RoPE shift invariance of fused RoPE keys -------------------------------------------------------
@pytest.mark.parametrize("plan", ["fusedkv", "fusedkv-dense", "single-source-scaling"])
def test_fused_rope_keys_keep_scores_relative(plan):
    model = mla_model(plan, dtype=torch.float64)
    assert (shifted_logits(model, 0) - shifted_logits(model, 37)).abs().max() < 1e-10


def test_untied_rope_key_weights_leak_absolute_position():
    model = mla_model("fusedkv", dtype=torch.float64, tie_rope_pairs=False)
    assert model.model.layers[2].self_attn.fusion.k_weight.shape == (2, 1, 8)
    assert (shifted_logits(model, 0) - shifted_logits(model, 37)).abs().max() > 1e-6


# ---- the cache: latents and RoPE keys of storage layers only ------------------------------------------
def test_measured_cache_bytes_equal_formula_and_paper_fractions():
    # r + d_R = 72 + 8 = 80 = half of MHA's 4 heads x (16 + 8 + 16) channels: the paper's 1/2 -> 1/4.
    sizes = {}
    for plan in ("vanilla", "fusedkv", "yoco", "cla"):
        model = mla_model(plan, kv_lora_rank=72)
        ids = torch.randint(1, 97, (2, 15))
        with torch.no_grad():
            _, cache = incremental_logits(model, ids, torch.ones_like(ids), 10)
        sizes[plan] = kv_cache_nbytes(cache)
        layers = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None
                  and layer.keys.numel()]
        assert len(layers) == len(model.plan.storage_layers)
        assert all(layer.keys.shape == (2, 1, 15, 72) and layer.values.shape == (2, 1, 15, 8) for layer in layers)
        assert sizes[plan] == model.config.kv_cache_bytes_per_token(4) * 2 * 15
    assert sizes["vanilla"] == 4 * (72 + 8) * 2 * 15 * 4  # layers x (r + d_R) x B x S x fp32
    assert mla_model("vanilla", kv_lora_rank=72).config.kv_cache_fraction() == 0.5
    assert mla_model("fusedkv", kv_lora_rank=72).config.kv_cache_fraction() == 0.25
    for plan in ("fusedkv", "yoco", "cla"):
        assert sizes[plan] * 2 == sizes["vanilla"]


def test_mla_checkpoint_roundtrip(tmp_path):
    model = mla_model("fusedkv")
    model.save_pretrained(tmp_path)
    loaded = FusedKVForCausalLM.from_pretrained(tmp_path).eval()
    assert "model.layers.3.self_attn.kv_a_proj_with_mqa.weight" not in loaded.state_dict()
    ids = torch.randint(1, 97, (1, 10))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_mla_trains():
    model = mla_model("fusedkv").train()
    ids = torch.randint(1, 97, (2, 16))
    model(ids, labels=ids, use_cache=False).loss.backward()
    fusion = model.model.layers[3].self_attn.fusion
    assert fusion.k_weight.grad.abs().sum() > 0 and fusion.v_weight.grad.abs().sum() > 0


# ---- bad configs ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, match", [
    (dict(kv_sharing="fusedkv-lite"), "fusedkv-lite does not apply to MLA"),
    (dict(kv_sharing="custom", kv_source_map=[{"layers": [3, 4], "k": 1, "v": 2}]), "same sources"),
    (dict(kv_lora_rank=128), "kv_lora_rank=128 does not compress"),
    (dict(kv_lora_rank=0), "kv_lora_rank=0"),
    (dict(q_lora_rank=96), "q_lora_rank=96 is not below"),
    (dict(qk_rope_head_dim=7), "head_dim=7: RoPE rotates channel pairs"),
    (dict(head_dim=16), "head_dim=16"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2"),
    (dict(fusion_init="iterative"), "iterative"),
    (dict(layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8),
     "sliding-window layers are not implemented"),
])
def test_bad_mla_configs_are_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**{**MLA, **overrides})
