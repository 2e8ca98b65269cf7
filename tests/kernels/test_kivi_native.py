"""Native attention over the KIVI cache (`fusedkv/kernels/cpu_kivi_attention.c`): against float64 attention
over the same integers (the cache's own codes, scales and zeros, dequantised in float64) at every bit width,
on both sides of the group and residual boundaries, with left padding, batch > 1 and the plans' sources;
its flush against the module path's quantiser, bit for bit; the native decode step over a KIVI cache against
the model's forward through the same cache (MoE layers and 16 rows included); `generate` with and without the
native step; what the step declines over a KIVI cache (window layers, MLA, soft-capped scores), by name."""

import copy

import pytest
import torch

from fusedkv.engine.native_step import MAX_ROWS, NativeDecodeStep, unsupported
from fusedkv.engine.selection import set_decode_layout
from fusedkv.generation import generate
from fusedkv.kernels import cpu_kivi, native
from fusedkv.plan import FULL, SLIDING
from fusedkv.quant import KIVICache, kivi_cache_factory
from fusedkv.quant.kivi import KIVILayer
from fusedkv.quant.kivi_codes import dequantize
from tests.conftest import tiny_config, tiny_model

pytestmark = pytest.mark.skipif(not native.available(), reason="the native CPU kernels are not built here")

G, R = 4, 8  # small group and residual: a few dozen tokens cross every boundary


def _fill(cache, n: int, batch: int, h_kv: int, d: int, starts=None, seed=0, reserve=True):
    """Store n tokens (after `starts[b]` padding columns) of random K/V in every storage layer, through the
    module path's `update` (one prompt block, then single tokens across the boundaries); returns what each
    layer holds in full precision (its history), [B, H, n, D] per layer, padding zeroed."""
    g = torch.Generator().manual_seed(seed)
    if starts is not None:
        mask = torch.ones(batch, n, dtype=torch.long)
        for b, s in enumerate(starts):
            mask[b, :s] = 0
        cache.set_padding(mask)
    if reserve:  # after the padding: a padded layer reserves each row's own buffers
        cache.reserve(batch, torch.float32)
    history = {}
    for i in (i for i, layer in enumerate(cache.layers) if isinstance(layer, KIVILayer)):
        k = torch.randn(batch, h_kv, n, d, generator=g) * 2 + 0.5
        v = torch.randn(batch, h_kv, n, d, generator=g)
        first = n // 2
        cache.layers[i].update(k[:, :, :first], v[:, :, :first])
        for t in range(first, n):
            cache.layers[i].update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        history[i] = (k, v)
    return history


def _held(layer, b: int, dtype=torch.float64):
    """What row b of a KIVI layer holds, dequantised in `dtype`: [H, n_b, D] keys and values."""
    row, i = (layer.rows[b], 0) if layer.rows is not None else (layer, b)
    parts_k = [row.keys[i]] if row.quantized_keys is None else [dequantize(row.quantized_keys, dtype)[i], row.keys[i]]
    parts_v = [row.values[i]] if row.quantized_values is None else [dequantize(row.quantized_values, dtype)[i],
                                                                    row.values[i]]
    return torch.cat([p.to(dtype) for p in parts_k], 1), torch.cat([p.to(dtype) for p in parts_v], 1)


def _reference(q, cache, k_layers, k_w, v_layers, v_w, scale, pending=None):
    """float64 factored-fusion attention, row by row, over what the cache holds (+ a pending token)."""
    b, h_q, _, d = q.shape
    out = torch.empty(b, h_q, d, dtype=torch.float64)
    for r in range(b):
        ks, vs = [], []
        for layers, weights, side, acc in ((k_layers, k_w, 0, ks), (v_layers, v_w, 1, vs)):
            fused = 0
            for i, w in zip(layers, weights):
                x = _held(cache.layers[i], r)[side]
                if pending is not None:
                    x = torch.cat([x, pending[i][side][r].to(torch.float64)], 1)
                fused = fused + (x if w is None else x * w.to(torch.float64).reshape(-1, 1, d))
            acc.append(fused)
        k, v = ks[0], vs[0]  # [H_kv, T, D]
        k = k.repeat_interleave(h_q // k.shape[0], 0)
        v = v.repeat_interleave(h_q // v.shape[0], 0)
        p = torch.softmax(q[r, :, 0].to(torch.float64).unsqueeze(1) @ k.transpose(1, 2) * scale, -1)
        out[r] = (p @ v)[:, 0]
    return out


SOURCES = {  # (key layers, value layers, weighted): vanilla's own, Lite's reuse of two layers, FusedKV's fusion
    "vanilla": ([0], [0], False),
    "fusedkv-lite": ([0], [1], False),
    "fusedkv": ([0, 1], [0, 1], True),
}


# (head_dim, group, residual): the portable loops (16 channels in groups of 4), and the vector loops
# (64 channels: 16 or 32 bytes a row, groups of 16 channels: whole AVX-512 / AVX2 vectors).
SHAPES = {"portable": (16, G, R), "vector": (64, 16, 32)}
LENGTHS = {  # tokens held, from the group size g and the residual length r: each side of every boundary
    "1": lambda g, r: 1, "G-1": lambda g, r: g - 1, "G+1": lambda g, r: g + 1, "R-1": lambda g, r: r - 1,
    "R": lambda g, r: r, "R+1": lambda g, r: r + 1, "2R-1": lambda g, r: 2 * r - 1, "2R+3": lambda g, r: 2 * r + 3,
    "5R": lambda g, r: 5 * r,
}


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("at", ["1", "G-1", "G+1", "R-1", "R", "R+1", "2R+3", "5R"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("sources", list(SOURCES))
def test_attention_matches_float64(bits, at, shape, sources):
    d, g_size, r_len = SHAPES[shape]
    n = LENGTHS[at](g_size, r_len)
    h_q, h_kv, batch = 4, 2, 2
    cfg = tiny_config(num_hidden_layers=2, num_key_value_heads=h_kv, head_dim=d, num_attention_heads=h_q,
                      kv_sharing="vanilla", max_position_embeddings=512)
    cache = KIVICache(cfg, bits, g_size, r_len, max_len=5 * r_len + 2)
    _fill(cache, n, batch, h_kv, d, seed=n)
    k_layers, v_layers, weighted = SOURCES[sources]
    g = torch.Generator().manual_seed(1)
    k_w = [torch.randn(h_kv, d, generator=g) if weighted else None for _ in k_layers]
    v_w = [torch.randn(h_kv, d, generator=g) if weighted else None for _ in v_layers]
    q = torch.randn(batch, h_q, 1, d, generator=g)
    got = cpu_kivi.attention(q, cache, k_layers, k_w, v_layers, v_w, d**-0.5)
    want = _reference(q, cache, k_layers, k_w, v_layers, v_w, d**-0.5)
    torch.testing.assert_close(got[:, :, 0].double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("per_kv", [1, 3, 5])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_attention_query_heads_per_kv_head(bits, per_kv, shape):
    """The kernel reads each code once for all the query heads of a kv head, two at a time: MHA (its own
    specialised loops), an odd count (a last head alone) and two pairs and one, against float64."""
    d, g_size, r_len = SHAPES[shape]
    n, h_kv, batch = 2 * r_len + 3, 2, 2
    h_q = h_kv * per_kv
    cfg = tiny_config(num_hidden_layers=2, num_key_value_heads=h_kv, head_dim=d, num_attention_heads=h_q,
                      kv_sharing="vanilla", max_position_embeddings=512)
    cache = KIVICache(cfg, bits, g_size, r_len, max_len=n + 2)
    _fill(cache, n, batch, h_kv, d, seed=per_kv)
    g = torch.Generator().manual_seed(3)
    w = [torch.randn(h_kv, d, generator=g) for _ in range(2)]
    q = torch.randn(batch, h_q, 1, d, generator=g)
    got = cpu_kivi.attention(q, cache, [0, 1], w, [0, 1], w[::-1], d**-0.5)
    want = _reference(q, cache, [0, 1], w, [0, 1], w[::-1], d**-0.5)
    torch.testing.assert_close(got[:, :, 0].double(), want, atol=2e-5, rtol=2e-5)


# (head_dim, group, residual) of the AVX2 loops over whole 16-byte units (`cpu_kivi_avx2.h`: nb % 16 == 0 and
# G % 16 == 0) at every count of value groups its pair weights take (D/G = 1, 2, 4 in vectors, 8 one at a time),
# and a head whose rows are not whole units at 4 bits (48 channels: the generic vector loops).
LAYOUTS = {"D/G=1": (32, 32, 64), "D/G=2": (64, 32, 64), "D/G=8": (128, 16, 32), "d48": (48, 16, 32)}


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("at", ["R+1", "2R+3"])
def test_attention_vector_layouts(bits, layout, at):
    """Odd and even counts of quantised values (row pairs and a last row alone), GQA (a pair of query heads and
    one alone), batch 2 and FusedKV's two weighted sources, against float64."""
    d, g_size, r_len = LAYOUTS[layout]
    n, h_kv, batch = LENGTHS[at](g_size, r_len), 2, 2
    h_q = 3 * h_kv
    cfg = tiny_config(num_hidden_layers=2, num_key_value_heads=h_kv, head_dim=d, num_attention_heads=h_q,
                      kv_sharing="vanilla", max_position_embeddings=512)
    cache = KIVICache(cfg, bits, g_size, r_len, max_len=n + 2)
    _fill(cache, n, batch, h_kv, d, seed=d + n)
    g = torch.Generator().manual_seed(5)
    w = [torch.randn(h_kv, d, generator=g) for _ in range(2)]
    q = torch.randn(batch, h_q, 1, d, generator=g) * 2
    got = cpu_kivi.attention(q, cache, [0, 1], w, [0, 1], w[::-1], d**-0.5)
    want = _reference(q, cache, [0, 1], w, [0, 1], w[::-1], d**-0.5)
    torch.testing.assert_close(got[:, :, 0].double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("at", ["R-1", "R", "2R-1", "2R+3"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_pending_token_and_flush_match_the_module_path(bits, at, shape):
    """Inside a step: one appended token is attended over in full precision, then flushed; the flushed cache
    holds the same bits as the module path's `update` of that token, with left padding (rows of their own)."""
    d, g_size, r_len = SHAPES[shape]
    n = LENGTHS[at](g_size, r_len)
    h_q, h_kv, batch = 4, 2, 3
    starts = [0, 3, 5]
    cfg = tiny_config(num_hidden_layers=2, num_key_value_heads=h_kv, head_dim=d, num_attention_heads=h_q,
                      kv_sharing="vanilla", max_position_embeddings=512)
    native_cache, module_cache = (KIVICache(cfg, bits, g_size, r_len, max_len=n + 2) for _ in range(2))
    _fill(native_cache, n, batch, h_kv, d, starts, seed=n)
    _fill(module_cache, n, batch, h_kv, d, starts, seed=n, reserve=False)
    g = torch.Generator().manual_seed(2)
    new = {i: (torch.randn(batch, h_kv, 1, d, generator=g) * 3, torch.randn(batch, h_kv, 1, d, generator=g))
           for i in (0, 1)}
    q = torch.randn(batch, h_q, 1, d, generator=g)
    w = [torch.randn(h_kv, d, generator=g) for _ in range(2)]
    want = _reference(q, native_cache, [0, 1], w, [0, 1], w[::-1], 0.3, pending=new)
    for i in (0, 1):
        cpu_kivi.append(native_cache, i, *new[i])
    got = cpu_kivi.attention(q, native_cache, [0, 1], w, [0, 1], w[::-1], 0.3, pending=True)
    torch.testing.assert_close(got[:, :, 0].double(), want, atol=2e-5, rtol=2e-5)
    for i in (0, 1):
        cpu_kivi.flush(native_cache, i, batch)
        module_cache.layers[i].update(*new[i])
        for b in range(batch):
            a, m = native_cache.layers[i].rows[b], module_cache.layers[i].rows[b]
            assert a.length == m.length
            for x, y in zip(a.tensors(), m.tensors()):
                assert torch.equal(x, y)


STEP_G, STEP_R = SHAPES["vector"][1:]  # the step's model has 64-channel heads: the vector loops


MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24)


def _kivi_model(plan, **overrides):
    model = tiny_model(plan, head_dim=SHAPES["vector"][0], max_position_embeddings=128, **overrides)
    set_decode_layout(model, "packed")
    return model


# The fast tier (-m 'not slow') runs a few cases of the two model-level tests below; the full suite all of them.
FAST_STEP = {(2, "fusedkv-lite"), (4, "fusedkv")}


@pytest.mark.parametrize("bits, plan, batch, overrides", [
    *(pytest.param(bits, plan, 2, {}, marks=() if (bits, plan) in FAST_STEP else pytest.mark.slow)
      for bits in (2, 4) for plan in ("vanilla", "fusedkv-lite", "fusedkv", "fusedkv-gqa")),
    (4, "fusedkv", 5, MOE),  # sparse MLPs in the step, over a KIVI cache
    pytest.param(2, "fusedkv", MAX_ROWS, {}, marks=pytest.mark.slow),  # the step's widest batch
])
def test_native_step_matches_the_forward(plan, bits, batch, overrides):
    """Each step over a reserved KIVI cache against the model's forward over a copy of that cache as it stands
    (its storage layers dequantise what is held, its reconstruction layers fuse what they return). A copy per
    step, not a second cache fed the same tokens: the step's K/V differ from the forward's in the last bits, and
    quantising can turn that into one code step, which later steps would then compare through."""
    model = _kivi_model(plan, **overrides)
    prompt, total = 13, 13 + 2 * STEP_R + 3
    ids = torch.randint(1, 97, (batch, total), generator=torch.Generator().manual_seed(0))
    cache = KIVICache(model.config, bits, STEP_G, STEP_R, max_len=total)
    with torch.inference_mode():
        step = NativeDecodeStep(model, {}, {}, batch, kivi=cache)
        model(ids[:, :prompt], cache=cache, use_cache=True)
        for pos in range(prompt, total):
            reference = copy.deepcopy(cache)
            want = model(ids[:, pos:pos + 1], cache=reference, use_cache=True).logits
            got = step(ids[:, pos:pos + 1], None, pos)
            cache.advance(1)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
            assert cache.get_seq_length() == reference.get_seq_length() == pos + 1
            assert cache.nbytes() == reference.nbytes()


@pytest.mark.parametrize("bits, plan, batch, overrides", [
    *(pytest.param(bits, plan, 3, {}, marks=() if (bits, plan) == (2, "fusedkv") else pytest.mark.slow)
      for bits in (2, 4) for plan in ("fusedkv", "fusedkv-lite")),
    pytest.param(4, "fusedkv", MAX_ROWS, MOE, marks=pytest.mark.slow),
])
def test_generate_same_tokens_with_and_without_the_native_step(plan, bits, batch, overrides):
    model = _kivi_model(plan, **overrides)
    ids = torch.randint(1, 97, (batch, 14), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    for row in range(1, batch):  # left padding of 0-12 tokens
        mask[row, : (row * 4 + 1) % 13] = 0
    factory = kivi_cache_factory(bits, STEP_G, STEP_R)
    native_run = generate(model, ids, 2 * STEP_R + 5, attention_mask=mask, cache_factory=factory)
    module_run = generate(model, ids, 2 * STEP_R + 5, attention_mask=mask, cache_factory=factory, native_step=False)
    assert native_run.native_step and not module_run.native_step
    assert torch.equal(native_run.tokens, module_run.tokens)
    assert native_run.cache_bytes == module_run.cache_bytes


@pytest.mark.parametrize("overrides, reason", [
    (dict(sliding_window=4, layer_types=[SLIDING, FULL, SLIDING, FULL]), "sliding-window layers over a KIVI cache"),
    (dict(attn_logit_softcapping=2.0), "soft-capping over a KIVI cache"),
    (dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=16), "MLA over a KIVI cache"),
])
def test_native_step_declines_what_the_kivi_kernel_lacks(overrides, reason):
    """The KIVI kernel attends over a whole history with plain scores: window layers, MLA and soft-capped
    scores over a KIVI cache stay module by module, by name, and `generate` then runs the modules."""
    model = _kivi_model("fusedkv", **overrides)
    cache = KIVICache(model.config, 4, STEP_G, STEP_R, max_len=32)
    assert reason in unsupported(model, {}, {}, 2, kivi=cache)
    ids = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(2))
    assert not generate(model, ids, 3, cache_factory=kivi_cache_factory(4, STEP_G, STEP_R)).native_step
