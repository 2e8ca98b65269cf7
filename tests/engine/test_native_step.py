"""The native decode step (`fusedkv.engine.native_step`) against the model's own forward: every plan it
covers, f32 and 16-bit caches, batch 1 and a left-padded batch; what it declines falls back."""

import copy

import pytest
import torch

from fusedkv.cache import StaticKVCache
from fusedkv.engine.native_step import NativeDecodeStep, unsupported
from fusedkv.engine.precision import reduce_precision
from fusedkv.engine.selection import select_runtime, set_decode_layout
from fusedkv.generation import generate
from fusedkv.kernels import cpu_gemv, native
from tests.conftest import PLAN_CONFIGS, tiered, tiny_model

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: the native CPU kernels are not built")

COVERED = [p for p in PLAN_CONFIGS if p != "fusedkv-dense"]  # 3+ sources (the iterative chain is unrolled)
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _packed(plan, **overrides):
    model = tiny_model(plan, **overrides)
    set_decode_layout(model, "packed")
    return model


def _padded_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 97, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding of different lengths
    mask[2, :5] = 0  # (inside the prompt: generation pads prompts only)
    return ids * mask, mask


CACHE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# The fast tier: every plan over an f32 cache, the 16-bit caches for vanilla and FusedKV.
@pytest.mark.parametrize("cache_dtype, plan", tiered(
    [(dtype, plan) for dtype in CACHE_DTYPES for plan in COVERED],
    lambda dtype, plan: dtype == torch.float32 or plan in ("vanilla", "fusedkv"),
    lambda dtype, plan: f"cache_dtype{CACHE_DTYPES.index(dtype)}-{plan}"))
def test_step_matches_the_full_forward(plan, cache_dtype):
    """Teacher-forced decode through the native step gives, at every position, the logits of one forward
    over the whole sequence (the plain reference), for a left-padded batch of 3."""
    model = _packed(plan, attention_bias=plan == "vanilla")
    ids, mask = _padded_batch()
    prompt, steps = 6, ids.shape[1] - 6
    cache = StaticKVCache(model.config, 3, ids.shape[1], cache_dtype)
    with torch.inference_mode():
        model(ids[:, :prompt], attention_mask=mask[:, :prompt], cache=cache, use_cache=True)
        step = NativeDecodeStep(model, cache.keys, cache.values, 3)
        kv_start = (mask[:, :prompt] == 0).sum(-1).to(torch.int64)
        got = []
        for i in range(prompt, prompt + steps):
            got.append(step(ids[:, i : i + 1], kv_start, cache.get_seq_length()))
            cache.advance(1)
        full = model(ids, attention_mask=mask).logits[:, prompt:]
    got = torch.cat(got, dim=1)
    real = mask[:, prompt:].bool()
    scale = full[real].abs().max()
    assert (got - full)[real].abs().max() <= TOL[cache_dtype] * scale


@pytest.mark.parametrize("plan", ["vanilla", "fusedkv-lite", "fusedkv", "fusedkv-gqa"])
def test_step_writes_the_cache_the_modules_write(plan):
    """The K/V the step writes into the static cache are the ones the storage layers' modules write."""
    model = _packed(plan)
    ids = torch.randint(1, 97, (1, 12), generator=torch.Generator().manual_seed(1))
    caches = [StaticKVCache(model.config, 1, 12) for _ in range(2)]
    with torch.inference_mode():
        for cache in caches:
            model(ids[:, :8], cache=cache, use_cache=True)
        step = NativeDecodeStep(model, caches[0].keys, caches[0].values, 1)
        for i in range(8, 12):
            step(ids[:, i : i + 1], None, caches[0].get_seq_length())
            caches[0].advance(1)
            model(ids[:, i : i + 1], cache=caches[1], use_cache=True)
    for layer in caches[0].keys:
        torch.testing.assert_close(caches[0].keys[layer], caches[1].keys[layer], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(caches[0].values[layer], caches[1].values[layer], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("plan", ["vanilla", "fusedkv", "yoco"])
def test_generate_with_and_without_the_step(plan):
    """`generate` takes the step by default; greedy tokens equal those of the module-by-module loop, for a
    right-padded batch too (re-aligned to the left before prefill)."""
    model = _packed(plan)
    ids, mask = _padded_batch(seed=2)
    ids, mask = ids.flip(-1), mask.flip(-1)  # right padding
    fast = generate(model, ids, 10, attention_mask=mask)
    slow = generate(model, ids, 10, attention_mask=mask, native_step=False)
    assert torch.equal(fast.tokens, slow.tokens)


def test_generate_uses_the_step(monkeypatch):
    """The step really runs in `generate` (a test of the fast path, not of the fallback)."""
    calls = []
    original = NativeDecodeStep.__call__
    monkeypatch.setattr(NativeDecodeStep, "__call__", lambda self, *a: calls.append(1) or original(self, *a))
    result = generate(_packed("fusedkv"), torch.randint(1, 97, (1, 5)), 6)
    assert len(calls) == 5 and result.native_step
    assert not generate(_packed("fusedkv"), torch.randint(1, 97, (1, 5)), 6, native_step=False).native_step


@pytest.mark.parametrize("case, overrides, batch, layout", [
    ("unpacked", {}, 1, "row-major"),
    ("batch above 16", {}, 17, "packed"),
    ("moe experts row-major", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), 1, "row-major"),
    ("mla row-major", dict(kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=16,
                           v_head_dim=16), 1, "row-major"),
])
def test_declined_models_fall_back(case, overrides, batch, layout):
    """What the step does not cover is named by `unsupported`, refused by the constructor with that
    reason, and `generate` then runs the modules (same tokens as forcing them)."""
    model = tiny_model("fusedkv", **overrides)
    set_decode_layout(model, layout)
    cache = StaticKVCache(model.config, batch, 16)
    reason = unsupported(model, cache.keys, cache.values, batch)
    assert reason
    with pytest.raises(ValueError, match="does not cover"):
        NativeDecodeStep(model, cache.keys, cache.values, batch)
    ids = torch.randint(1, 97, (batch, 5), generator=torch.Generator().manual_seed(3))
    fallback = generate(model, ids, 4)
    assert not fallback.native_step  # the modules ran, and gave what forcing them gives
    assert torch.equal(fallback.tokens, generate(model, ids, 4, native_step=False).tokens)


def test_bf16_model_is_declined():
    model = _packed("vanilla")
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    cache = StaticKVCache(bf16.config, 1, 16, torch.bfloat16)
    assert "f32" in unsupported(bf16, cache.keys, cache.values, 1)


def test_kernels_off_declines(torch_kernels):
    model = _packed("vanilla")
    cache = StaticKVCache(model.config, 1, 16)
    assert "not built" in unsupported(model, cache.keys, cache.values, 1)


def _prefilled_step(batch: int, max_len: int, prompt: int):
    """A vanilla model's native step over a static cache holding a random prompt of `prompt` tokens."""
    model = _packed("vanilla")
    cache = StaticKVCache(model.config, batch, max_len)
    with torch.inference_mode():
        model(torch.randint(1, 97, (batch, prompt)), cache=cache, use_cache=True)
    return NativeDecodeStep(model, cache.keys, cache.values, batch), cache


@torch.inference_mode()
def test_full_cache_is_refused_with_a_message():
    step, cache = _prefilled_step(1, 4, 4)
    with pytest.raises(RuntimeError, match="refused its arguments"):
        step(torch.tensor([[5]]), None, cache.get_seq_length())
    with pytest.raises(ValueError, match="full"):
        cache.advance(1)


_needs_blocks = pytest.mark.skipif(not cpu_gemv.blocks_available(),
                                 reason="no block kernels here (AVX-512 BF16 or AVX2): no bf16 / int8 block weights")


@pytest.mark.parametrize("plan", ["vanilla", "fusedkv-lite", "fusedkv", "fusedkv-gqa"])
@pytest.mark.parametrize("fmt", [pytest.param("bfloat16", marks=_needs_blocks),
                                 pytest.param("int8", marks=_needs_blocks), "int4",
                                 pytest.param("float16", marks=pytest.mark.skipif(
                                     not cpu_gemv.f16_blocks_available(), reason="no AVX2 + F16C here"))])
def test_step_with_reduced_weights_matches_module_decode(plan, fmt):
    """bf16 / int8 / int4 / f16 block weights: the step runs the modules' own block kernels, so teacher-forced logits
    match module-by-module decode of the same reduced model closely, for a left-padded batch. The two agree
    bit for bit until an f32 ulp of difference upstream (norms, attention) flips the bf16 rounding of one
    input element of a product (2^-8 of it), which moves the logits by up to ~1e-3 of their largest (measured:
    int4 1.3e-3 relative on this batch with AVX-512's bf16 dot products, 4.6e-3 with AVX2's portable loop; bf16
    1.4e-3 at one step of five with AVX2's blocks, every other step bit for bit); a layout error would be of
    order 1."""
    tol = 1e-2
    model = reduce_precision(tiny_model(plan, attention_bias=plan == "vanilla"), fmt)
    ids, mask = _padded_batch(seed=4)
    prompt = 6
    caches = [StaticKVCache(model.config, 3, ids.shape[1]) for _ in range(2)]
    # the modules as the runtime runs them (its product kernels, the fused QK-norm + RoPE pass: the step's
    # arithmetic), with the model's own attention
    with torch.inference_mode(), select_runtime(model, "materialized"):
        for cache in caches:
            model(ids[:, :prompt], attention_mask=mask[:, :prompt], cache=cache, use_cache=True)
        step = NativeDecodeStep(model, caches[0].keys, caches[0].values, 3)
        kv_start = (mask[:, :prompt] == 0).sum(-1).to(torch.int64)
        for i in range(prompt, ids.shape[1]):
            got = step(ids[:, i : i + 1], kv_start, caches[0].get_seq_length())
            caches[0].advance(1)
            ref = model(ids[:, i : i + 1], attention_mask=mask[:, : i + 1], cache=caches[1], use_cache=True).logits
            assert (got - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("plan, head", [("vanilla", None), ("fusedkv", None), ("vanilla", "int4")])
def test_int4_generate_with_and_without_the_native_step(plan, head):
    """--weights int4 (LM head at int8 by default, or int4 too): the native step (int4 blocks in the C step)
    and the module path (the same kernel per product) give the same greedy tokens, batch 1 and a batch of 2."""
    model = reduce_precision(tiny_model(plan), "int4", head)
    cache = StaticKVCache(model.config, 1, 16)
    assert unsupported(model, cache.keys, cache.values, 1) is None
    for prompt in (torch.tensor([[5, 9, 2, 41, 7]]), torch.randint(1, 97, (2, 6), generator=torch.Generator())):
        native_tokens = generate(model, prompt, 10).tokens
        assert torch.equal(native_tokens, generate(model, prompt, 10, native_step=False).tokens)


def test_f16_weights_run_where_their_blocks_do():
    """f16 weights are stored as blocks (and taken by the step) where AVX2 + F16C are; elsewhere they stay
    [out, in] f16 for PyTorch's kernels and the step declines them, saying which layouts it reads."""
    model = reduce_precision(tiny_model("vanilla"), "float16")
    cache = StaticKVCache(model.config, 1, 16)
    why = unsupported(model, cache.keys, cache.values, 1)
    if cpu_gemv.f16_blocks_available():
        assert why is None
    else:
        assert "bf16 / f16 / int8 / int4 blocks" in why


@torch.inference_mode()
def test_wrong_shapes_are_refused_with_a_message():
    step, cache = _prefilled_step(2, 8, 3)
    with pytest.raises(ValueError, match="built for 2 rows"):
        step(torch.tensor([[5]]), None, cache.get_seq_length())
    with pytest.raises(ValueError, match="built for 2 rows"):
        step(torch.tensor([[5], [6]]), torch.zeros(3, dtype=torch.int64), cache.get_seq_length())
    ok = step(torch.tensor([[5], [6]]), torch.zeros(2, dtype=torch.int32), cache.get_seq_length())  # widened
    assert ok.shape == (2, 1, 97)
