"""The native decode step (`fusedkv.engine.native_step`) on what it used to decline: the imported families'
block features (biases, no QK-norm, Gemma's norms, GeGLU, score scalar, soft-capping, scaled and per-type
RoPE), sliding-window layers over their ring caches, and batches up to 16; each against the model's full
forward (teacher-forced, left-padded), and `generate` with and without the step giving the same greedy tokens."""

import pytest
import torch

from fusedkv.cache import StaticKVCache
from fusedkv.engine.native_step import NativeDecodeStep, unsupported
from fusedkv.engine.selection import set_decode_layout
from fusedkv.generation import generate
from fusedkv.kernels import native
from fusedkv.plan import FULL, SLIDING
from tests.conftest import tiny_model

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: the native CPU kernels are not built")

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
WINDOW = 4
HYBRID = dict(sliding_window=WINDOW, layer_types=[SLIDING, FULL, SLIDING, FULL])
GEMMA_ROPE = {FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
              SLIDING: {"rope_type": "default", "rope_theta": 1e4}}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
# Each imported family's block features as model options (the fields `fusedkv convert` sets).
FEATURES = {
    "llama": dict(use_qk_norm=False, attention_bias=True, mlp_bias=True, rope_parameters=LLAMA3_ROPE),
    "llama-gelu-yarn": dict(use_qk_norm=False, hidden_act="gelu_new", rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32}),
    "qwen2": dict(use_qk_norm=False, attention_bias=True, attention_output_bias=False),
    "qwen3-gelu": dict(hidden_act="gelu"),
    "gemma3": dict(rms_norm_unit_offset=True, use_post_norms=True, query_pre_attn_scalar=24, embedding_multiplier=8.0,
                   hidden_act="gelu_pytorch_tanh", final_logit_softcapping=3.0, rope_parameters=GEMMA_ROPE, **HYBRID),
    "gemma2": dict(use_qk_norm=False, rms_norm_unit_offset=True, use_post_norms=True, query_pre_attn_scalar=32,
                   attn_logit_softcapping=2.0, final_logit_softcapping=3.0, embedding_multiplier=8.0,
                   hidden_act="gelu_pytorch_tanh", **HYBRID),
    "window": HYBRID,
    "window-everywhere": dict(sliding_window=WINDOW, layer_types=[SLIDING] * 4),
}


def _model(plan, **overrides):
    model = tiny_model(plan, **overrides)
    with torch.no_grad():  # norms away from their initial gains, so that a missed 1 + w or post-norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return set_decode_layout(model, "packed")


def _padded(batch, length, prompt, seed=0):
    """A batch whose rows are left-padded by 0 to min(prompt - 1, 5) tokens (inside the prompt)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 97, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for row in range(1, batch):
        mask[row, : (row * 3) % min(prompt, 6)] = 0
    return ids * mask, mask


def _teacher_forced(model, ids, mask, prompt, cache_dtype=torch.float32):
    """Logits of the native step at every position after the prompt, and of the full forward there."""
    batch = ids.shape[0]
    cache = StaticKVCache(model.config, batch, ids.shape[1], cache_dtype)
    cache.set_padding(mask[:, :prompt])
    with torch.inference_mode():
        model(ids[:, :prompt], attention_mask=mask[:, :prompt], cache=cache, use_cache=True)
        step = NativeDecodeStep(model, cache.keys, cache.values, batch, cache.window_start, cache.max_len)
        kv_start = (mask[:, :prompt] == 0).sum(-1).to(torch.int64)
        got = []
        for i in range(prompt, ids.shape[1]):
            got.append(step(ids[:, i : i + 1], kv_start, cache.get_seq_length()))
            cache.advance(1)
        full = model(ids, attention_mask=mask).logits[:, prompt:]
    return torch.cat(got, dim=1), full


def _assert_close(got, full, mask, tol):
    real = mask.bool()
    assert (got - full)[real].abs().max() <= tol * full[real].abs().max()


@pytest.mark.parametrize("family", list(FEATURES))
@pytest.mark.parametrize("plan", ["vanilla", "fusedkv"])
def test_family_features_match_the_full_forward(family, plan):
    """Every imported family's block, windows longer than the window included (prompt 6 and 8 steps over a
    window of 4), for a left-padded batch of 3."""
    model = _model(plan, **FEATURES[family])
    ids, mask = _padded(3, 14, 6, seed=1)
    got, full = _teacher_forced(model, ids, mask, prompt=6)
    _assert_close(got, full, mask[:, 6:], TOL[torch.float32])


@pytest.mark.parametrize("plan, shared", [("vanilla", None), ("fusedkv", None), ("fusedkv", [SLIDING]),
                                          ("fusedkv-lite", None), ("yoco", None)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("prompt", [2, 9])
def test_window_rings_match_the_full_forward(plan, shared, cache_dtype, prompt):
    """Window layers read their ring (W - 1 slots) and the step's own token; short prompts (the ring not yet
    full) and long ones, padding that leaves the window mid-decode, every cache dtype, the +W and +WF plans."""
    model = _model(plan, shared_attention_types=shared, **HYBRID)
    ids, mask = _padded(4, prompt + 9, prompt, seed=2)
    got, full = _teacher_forced(model, ids, mask, prompt, cache_dtype)
    _assert_close(got, full, mask[:, prompt:], TOL[cache_dtype])


def test_ring_holds_what_the_modules_write():
    """After native steps the window rings hold, slot for slot, what module-by-module decode puts there."""
    model = _model("fusedkv", **HYBRID)
    ids, mask = _padded(3, 13, 5, seed=3)
    caches = [StaticKVCache(model.config, 3, 13) for _ in range(2)]
    kv_start = (mask[:, :5] == 0).sum(-1)
    with torch.inference_mode():
        for cache in caches:
            cache.set_padding(mask[:, :5])
            model(ids[:, :5], attention_mask=mask[:, :5], cache=cache, use_cache=True)
        step = NativeDecodeStep(model, caches[0].keys, caches[0].values, 3, caches[0].window_start)
        for i in range(5, 13):
            step(ids[:, i : i + 1], kv_start, caches[0].get_seq_length())
            caches[0].advance(1)
            model(ids[:, i : i + 1], attention_mask=mask[:, : i + 1], cache=caches[1], use_cache=True)
    for layer in caches[0].keys:
        assert caches[0].keys[layer].shape[2] == (WINDOW - 1 if layer % 2 == 0 else 13)
        torch.testing.assert_close(caches[0].keys[layer], caches[1].keys[layer], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(caches[0].values[layer], caches[1].values[layer], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("plan", ["vanilla", "fusedkv"])
def test_batch_16_with_left_padding(plan):
    model = _model(plan, **HYBRID)
    ids, mask = _padded(16, 12, 5, seed=4)
    got, full = _teacher_forced(model, ids, mask, prompt=5)
    _assert_close(got, full, mask[:, 5:], TOL[torch.float32])


def test_window_start_must_match_the_rings():
    model = _model("vanilla", **HYBRID)
    ids, mask = _padded(2, 8, 4)
    cache = StaticKVCache(model.config, 2, 8)
    with torch.inference_mode():  # the prompt's padding never told to the cache
        model(ids[:, :4], attention_mask=mask[:, :4], cache=cache, use_cache=True)
        step = NativeDecodeStep(model, cache.keys, cache.values, 2, cache.window_start)
        with pytest.raises(ValueError, match="window_start"):
            step(ids[:, 4:5], torch.tensor([0, 3]), 4)


@pytest.mark.parametrize("family, plan, batch", [("gemma3", "fusedkv", 3), ("gemma2", "vanilla", 2),
                                                 ("llama", "fusedkv", 16), ("window-everywhere", "vanilla", 5)])
def test_generate_with_and_without_the_step(family, plan, batch):
    """Greedy tokens of `generate` with the native step equal those of the module-by-module loop, for a
    right-padded batch (re-aligned to the left before prefill) decoding past the window."""
    model = _model(plan, **FEATURES[family])
    ids, mask = _padded(batch, 7, 7, seed=5)
    ids, mask = ids.flip(-1), mask.flip(-1)
    cache = StaticKVCache(model.config, batch, 19)
    assert unsupported(model, cache.keys, cache.values, batch) is None
    fast = generate(model, ids, 12, attention_mask=mask)
    slow = generate(model, ids, 12, attention_mask=mask, native_step=False)
    assert fast.native_step and not slow.native_step
    assert torch.equal(fast.tokens, slow.tokens)


def test_dynamic_rope_is_declined():
    model = _model("vanilla", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    cache = StaticKVCache(model.config, 1, 16)
    assert "dynamic" in unsupported(model, cache.keys, cache.values, 1)


MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24)
# Qwen3-MoE's routing, then DeepSeek-V2's and V3's (groups, shared experts, scaling), with a dense first layer.
ROUTINGS = {
    "qwen3-moe": dict(MOE, norm_topk_prob=True),
    "qwen3-moe-sparse-step": dict(MOE, decoder_sparse_step=2, mlp_only_layers=[0]),
    "deepseek-v2": dict(MOE, topk_method="group_limited_greedy", n_group=3, topk_group=2, n_shared_experts=1,
                        routed_scaling_factor=1.5, mlp_only_layers=[0]),
    "deepseek-v3": dict(MOE, topk_method="noaux_tc", n_group=3, topk_group=2, n_shared_experts=2,
                        norm_topk_prob=True, routed_scaling_factor=2.5),
}


def _moe_model(plan, routing, **overrides):
    model = _model(plan, **ROUTINGS[routing], **overrides)
    for layer in model.model.layers:  # a trained V3 router's correction bias is not zero
        bias = getattr(layer.mlp, "gate", None) and getattr(layer.mlp.gate, "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(torch.randn(bias.shape) * 0.1)
    return model


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("plan", ["vanilla", "fusedkv"])
def test_moe_matches_the_full_forward(routing, plan):
    """Sparse MLPs in the step: routing as the module routes, each chosen expert's GEMVs over its rows,
    shared experts; a left-padded batch of 5, a window hybrid for the V3 case."""
    model = _moe_model(plan, routing, **(HYBRID if routing == "deepseek-v3" else {}))
    ids, mask = _padded(5, 13, 6, seed=6)
    got, full = _teacher_forced(model, ids, mask, prompt=6)
    _assert_close(got, full, mask[:, 6:], TOL[torch.float32])


@pytest.mark.parametrize("routing, batch", [("qwen3-moe", 1), ("deepseek-v3", 16)])
def test_moe_generate_with_and_without_the_step(routing, batch):
    model = _moe_model("fusedkv", routing)
    ids, mask = _padded(batch, 6, 6, seed=7)
    fast = generate(model, ids, 10, attention_mask=mask)
    slow = generate(model, ids, 10, attention_mask=mask, native_step=False)
    assert fast.native_step and torch.equal(fast.tokens, slow.tokens)


def test_moe_experts_outside_the_decode_layout_are_declined():
    model = tiny_model("fusedkv", **MOE)  # not packed: experts row-major
    cache = StaticKVCache(model.config, 1, 16)
    assert "experts" in unsupported(model, cache.keys, cache.values, 1)


def test_auto_layout_packs_for_the_step_up_to_16_rows():
    """`weight_layout="auto"` packs the weights for the native step at batch 5-16 (the modules alone would
    take the row-major layout there); a model the step declines (dynamic NTK RoPE) gets the row-major layout
    after all."""
    from fusedkv.engine.packing import is_packed

    ids = torch.randint(1, 97, (12, 5), generator=torch.Generator().manual_seed(8))
    model = tiny_model("fusedkv")
    fast = generate(model, ids, 4, weight_layout="auto")
    assert fast.native_step and is_packed(model)
    slow = generate(model, ids, 4, weight_layout="auto", native_step=False)
    assert not is_packed(model) and torch.equal(fast.tokens, slow.tokens)
    dynamic = tiny_model("fusedkv", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    assert not generate(dynamic, ids, 4, weight_layout="auto").native_step and not is_packed(dynamic)


MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, head_dim=8)
MLAS = {
    "full-rank-query": dict(MLA, q_lora_rank=None),
    "low-rank-query-interleaved": dict(MLA, q_lora_rank=24, rope_interleave=True),
    "yarn-moe": dict(MLA, q_lora_rank=24, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale_all_dim": 1.0}, **ROUTINGS["deepseek-v3"]),
}


@pytest.mark.parametrize("variant", list(MLAS))
@pytest.mark.parametrize("plan", ["vanilla", "fusedkv"])
def test_mla_matches_the_full_forward(variant, plan):
    """MLA absorbed over the cached latents and RoPE keys (FusedKV fusing them), for a left-padded batch."""
    model = _model(plan, **MLAS[variant])
    ids, mask = _padded(3, 13, 6, seed=9)
    got, full = _teacher_forced(model, ids, mask, prompt=6)
    _assert_close(got, full, mask[:, 6:], TOL[torch.float32])


def test_mla_generate_with_and_without_the_step():
    model = _model("fusedkv", **MLAS["low-rank-query-interleaved"])
    ids, mask = _padded(4, 6, 6, seed=10)
    fast = generate(model, ids, 10, attention_mask=mask)
    slow = generate(model, ids, 10, attention_mask=mask, native_step=False)
    assert fast.native_step and torch.equal(fast.tokens, slow.tokens)
