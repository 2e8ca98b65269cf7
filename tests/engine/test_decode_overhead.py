"""The trimmed CPU decode step: one-token attention over a 16-bit KV cache runs in f32, over the cache
widened as read by the native kernel or over a copy upcast once per storage layer with PyTorch's
kernels (either equals attention over the same values stored in f32); longer blocks (prefill) keep the
cache's dtype, except an f16 cache on a processor without f16 arithmetic, which they attend over in f32."""

import pytest
import torch

from fusedkv.cache import StaticKVCache
from fusedkv.engine import select_runtime
from fusedkv.engine.backends import f32_block_dtypes
from fusedkv.kernels.reference import materialized_attention
from fusedkv.model.attention import KVState
from fusedkv.model.layers import apply_rope, rope_cos_sin
from tests.conftest import tiny_model


def _sources(model, kv_dtype, seq=13, seed=0):
    """Post-RoPE K/V of every storage layer, stored in `kv_dtype`: what a 16-bit cache holds."""
    g = torch.Generator().manual_seed(seed)
    c = model.config
    shape = (2, c.num_key_value_heads, seq, c.head_dim)
    return {i: (torch.randn(shape, generator=g).to(kv_dtype), torch.randn(shape, generator=g).to(kv_dtype))
            for i in c.plan.storage_layers}


@pytest.mark.parametrize("plan", ["fusedkv-lite", "fusedkv", "fusedkv-gqa"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_one_token_attention_over_a_16bit_cache_equals_f32_attention_over_its_values(plan, kv_dtype,
                                                                                      decode_kernels):
    # Reconstruction layers (native kernel; or reuse: SDPA path, weighted: factored path) at one query row:
    # the result over bf16/f16 sources must equal the result over the same values held in f32 (nothing
    # rounded to 16 bits on the way), and both must match a float64 reference.
    model = tiny_model(plan)
    select_runtime(model)  # the engine's implementations (a plain model attends in the cache's dtype)
    c = model.config
    layer = next(lay for lay in model.model.layers if not lay.self_attn.layer.stores).self_attn
    x = torch.randn(2, 1, c.hidden_size, generator=torch.Generator().manual_seed(1))
    cos, sin = rope_cos_sin(torch.full((2, 1), 12), c.head_dim, c.rope_theta, torch.float32)
    half = _sources(model, kv_dtype)
    wide = {i: (k.float(), v.float()) for i, (k, v) in half.items()}
    outs = []
    with torch.inference_mode():
        for sources in (half, wide):
            kv = KVState()
            kv.layers.update(sources)
            outs.append(layer(x, cos, sin, None, kv))
        assert outs[0].dtype == torch.float32
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)
        # float64 reference: the same layer's query, attention over the fused f64 sources, its O projection.
        q = layer.q_norm(layer.q_proj(x).view(2, 1, c.num_attention_heads, c.head_dim).transpose(1, 2))
        q = q * cos + q.roll(c.head_dim // 2, dims=-1) * sin
        lk, lv = layer.layer.k_sources, layer.layer.v_sources
        k_w = [None] * len(lk) if layer.layer.k_fusion == "reuse" else layer.fusion.key_weights()
        v_w = [None] * len(lv) if layer.layer.v_fusion == "reuse" else layer.fusion.value_weights()
        ref = materialized_attention(q.double(), [wide[s][0].double() for s in lk], [w if w is None else w.double()
                                     for w in k_w], [wide[s][1].double() for s in lv],
                                     [w if w is None else w.double() for w in v_w], scale=layer.scale)
        ref = torch.nn.functional.linear(ref.transpose(1, 2).reshape(2, 1, -1), layer.o_proj.weight.double())
    torch.testing.assert_close(outs[0].double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_blocks_over_an_f16_cache_attend_in_f32_without_f16_arithmetic(kv_dtype):
    # A block longer than a decode step (a prefill): over f16 sources on a processor without f16 arithmetic
    # it attends in f32 (PyTorch's CPU SDPA emulates f16, ~3x slower), so it equals attention over the same
    # values held in f32; over bf16 it keeps the cache's dtype (the query rounded to bf16: not equal).
    model = tiny_model("fusedkv")
    select_runtime(model)
    c = model.config
    layer = next(lay for lay in model.model.layers if not lay.self_attn.layer.stores).self_attn
    t = 20  # > SHORT_QUERY: the block path
    x = torch.randn(2, t, c.hidden_size, generator=torch.Generator().manual_seed(1))
    cos, sin = rope_cos_sin(torch.arange(t).expand(2, t), c.head_dim, c.rope_theta, torch.float32)
    half = _sources(model, kv_dtype, seq=t)
    wide = {i: (k.float(), v.float()) for i, (k, v) in half.items()}
    outs = []
    with torch.inference_mode():
        for sources in (half, wide):
            kv = KVState(causal=True)
            kv.layers.update(sources)
            outs.append(layer(x, cos, sin, None, kv))
    assert outs[0].dtype == torch.float32
    if kv_dtype in f32_block_dtypes(cpu=True):
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)
    else:
        assert (outs[0] - outs[1]).abs().max() > 1e-5


@pytest.mark.parametrize("plan", ["vanilla", "fusedkv"])
def test_16bit_cache_decode_step_is_as_close_as_prefill_allows(plan, decode_kernels):
    # Whole model: decoding with a bf16 cache under f32 weights gives the logits of the f32 model decoding
    # over an f32 cache holding the bf16 cache's rounded prefix, up to the new token's own rounding.
    model = tiny_model(plan)
    select_runtime(model)
    ids = torch.randint(1, 97, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        half = StaticKVCache(model.config, 2, 16, torch.bfloat16)
        model(ids[:, :-1], cache=half, use_cache=True)
        wide = StaticKVCache(model.config, 2, 16, torch.float32)
        for i in half.keys:
            wide.keys[i].copy_(half.keys[i])
            wide.values[i].copy_(half.values[i])
        wide._length = half.get_seq_length()
        a = model(ids[:, -1:], cache=half, use_cache=True).logits
        b = model(ids[:, -1:], cache=wide, use_cache=True).logits
    # Only the new token's K/V differ (rounded to bf16 in one cache): a small, non-zero difference.
    assert a.dtype == torch.float32
    assert 0 < (a - b).abs().max() / b.abs().max() < 1e-3  # attending in bf16 instead: 1.3e-3 to 2e-3


@pytest.mark.parametrize("plan", ["vanilla", "fusedkv-gqa"])
def test_joint_qk_norm_and_rope_equal_the_modules_bit_for_bit(plan):
    # Short inference blocks normalise and rotate Q|K in one pass; it must be the very arithmetic of
    # q_norm/k_norm (RMSNorm) and apply_rope, per head, so decode and the full forward stay identical.
    model = tiny_model(plan)
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.q_norm.weight.normal_()
        attn.k_norm.weight.normal_()
    x = torch.randn(2, 3, model.config.hidden_size)
    cos, sin = rope_cos_sin(torch.arange(3).expand(2, 3) + 5, model.config.head_dim, model.config.rope_theta,
                            torch.float32)
    with torch.no_grad():
        q, k = attn.q_proj(x), attn.k_proj(x)
        joint_q, joint_k = attn._qk_norm_rope(q, k, cos, sin)
        q_ref = apply_rope(attn.q_norm(attn._heads(q, attn.num_heads)), cos, sin)
        k_ref = apply_rope(attn.k_norm(attn._heads(k, attn.num_kv_heads)), cos, sin)
    assert joint_q.shape == q_ref.shape and joint_k.shape == k_ref.shape
    assert torch.equal(joint_q, q_ref) and torch.equal(joint_k, k_ref)


@pytest.mark.parametrize("plan", ["fusedkv-lite", "fusedkv", "fusedkv-iterative"])
def test_storage_layers_share_their_f32_copy_with_the_layers_reading_them(plan, torch_kernels):
    # With a 16-bit cache and PyTorch's kernels, a decode step's storage layer upcasts its K/V once and hands
    # the f32 copy to the reconstruction layers reading it; they must get what converting the cache
    # themselves gives.
    model = tiny_model(plan)
    select_runtime(model)
    layers = [lay.self_attn for lay in model.model.layers]
    sources = {s for a in layers if not a.layer.stores for s in (*a.layer.k_sources, *a.layer.v_sources)}
    assert {a.layer.index for a in layers if a.read_later} == sources
    assert not any(a.read_later for a in tiny_model("vanilla").model.layers.modules() if hasattr(a, "read_later"))
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    logits = []
    with torch.inference_mode():
        for share in (True, False):
            for a in layers:
                a.read_later = share and a.layer.index in sources
            cache = StaticKVCache(model.config, 2, 12, torch.bfloat16)
            model(ids[:, :-2], cache=cache, use_cache=True)
            logits.append(torch.cat([model(ids[:, t:t + 1], cache=cache, use_cache=True).logits
                                     for t in (7, 8)], 1))
    assert torch.equal(logits[0], logits[1])
