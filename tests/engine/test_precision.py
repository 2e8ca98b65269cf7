"""Reduced-precision weights (fusedkv.engine.precision): every format against the f32 reference within
its documented tolerance, and incremental decode against the full forward of the same reduced model."""

import copy

import pytest
import torch

from fusedkv.cache import StaticKVCache
from fusedkv.engine.packing import unpack_weights
from fusedkv.engine.precision import (
    ReducedLinear,
    half_dtype,
    head_format,
    int8_activation_dtype,
    quantize_int4,
    quantize_int8,
    reduce_precision,
    weight_format,
    weight_nbytes,
)
from fusedkv.engine.selection import select_products, set_decode_layout
from fusedkv.generation import generate
from tests.conftest import tiny_model

# Max |logit - f32 logit| relative to max |f32 logit| (docs/cpu-decode.md): the rounding of
# weights and of the products' inputs, bf16 8 significant bits, f16 11, int8 per-channel 7 + sign.
# Measured on these random models (3 seeds x 3 plans): bf16 <= 0.020, f16 <= 0.0025, int8 <= 0.057.
LOGIT_TOL = {"bfloat16": 3e-2, "float16": 4e-3, "int8": 8e-2}
# Decode vs the same model's full forward: both round the same weights; only the kernel (GEMV vs GEMM)
# and the rounding of activations differ.
DECODE_TOL = {"bfloat16": 3e-2, "float16": 3e-3, "int8": 3e-2}
FORMATS = list(LOGIT_TOL)


def _trained_like(plan: str, seed: int = 0):
    """A tiny model with weights of a realistic spread (init std 0.02 gives near-zero logits)."""
    model = tiny_model(plan, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    return model


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("plan", ["vanilla", "fusedkv-lite", "fusedkv"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_reduced_logits_match_f32_within_tolerance(plan, fmt):
    ref_model = _trained_like(plan)
    model = reduce_precision(copy.deepcopy(ref_model), fmt)
    ids = torch.randint(1, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, out = ref_model(ids).logits, model(ids).logits
    assert out.dtype == torch.float32
    assert _rel(out, ref) < LOGIT_TOL[fmt]
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.85  # random weights: many near-ties
    assert 0 < _rel(out, ref)  # really reduced: a no-op conversion would pass the bound trivially


@pytest.mark.parametrize("plan,batch", [("vanilla", 1), ("fusedkv-lite", 4), ("fusedkv", 1), ("fusedkv", 4)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_incremental_decode_matches_full_forward(plan, fmt, batch):
    model = reduce_precision(_trained_like(plan), fmt)
    ids = torch.randint(1, 97, (batch, 10), generator=torch.Generator().manual_seed(2))
    cache = StaticKVCache(model.config, batch, 24)
    logits = []
    with torch.no_grad():
        out = model(ids, cache=cache, use_cache=True)  # prefill: many rows, the GEMM route
        logits.append(out.logits[:, -1])
        seq = ids
        for _ in range(8):  # one-token steps: the GEMV kernels
            nxt = logits[-1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
            logits.append(model(nxt, cache=cache, use_cache=True).logits[:, -1])
        full = model(seq).logits[:, ids.shape[1] - 1:]
    step = torch.stack(logits, 1)
    assert _rel(step, full) < DECODE_TOL[fmt]
    # The same next token wherever the full forward's choice is clear by more than the tolerance.
    top2 = full.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * DECODE_TOL[fmt] * full.abs().max()
    assert torch.equal(step.argmax(-1)[clear], full.argmax(-1)[clear])


def test_against_dequantized_reference_is_tight():
    """The reduced model equals the f32 model holding the rounded weights, up to activation rounding."""
    ref_model = _trained_like("vanilla")
    model = reduce_precision(copy.deepcopy(ref_model), "float16")
    deq = copy.deepcopy(ref_model)
    with torch.no_grad():
        for name, p in deq.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.copy_(p.half().float())
    ids = torch.randint(1, 97, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b, r = model(ids).logits, deq(ids).logits, ref_model(ids).logits
    assert _rel(a, b) < _rel(a, r) and _rel(a, b) < 2e-3


def test_int8_quantization_is_per_channel_and_round_to_nearest():
    w = torch.randn(6, 32) * torch.logspace(-3, 1, 6)[:, None]  # rows of very different scale
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (6,) and q.abs().max() == 127
    err = (q.float() * scale[:, None] - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-7).all())


def test_int4_quantization_follows_q4_0():
    """rule q4_0: groups of 32 inputs, one f16 scale each: the largest-magnitude weight of a group is level -8
    exactly, the others round to nearest (within half a step, or clamped to +7), a zero group stays zero."""
    w = torch.randn(6, 70) * torch.logspace(-3, 1, 6)[:, None]
    w[0, 32:64] = 0
    q, scale = quantize_int4(w, rule="q4_0")
    assert q.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape == (6, 3)
    assert q.min() == -8 and q.max() <= 7 and not q[0, 32:64].any()
    d = scale.float().repeat_interleave(32, 1)[:, :70]
    err = (q.float() * d - w).abs()
    assert bool(((err <= d.abs() / 2 + 1e-6 * w.abs() + 1e-12) | (q == 7)).all())
    g = w.reshape(6, -1)[:, :64].reshape(6, 2, 32)
    top = g.abs().argmax(-1, keepdim=True)
    assert (q[:, :64].reshape(6, 2, 32).gather(2, top)[scale[:, :2, None] != 0] == -8).all()


def test_int4_mse_rule_beats_q4_0_and_keeps_its_format():
    """rule mse (the default): the same format (f16 scale per 32 inputs, levels -8..7, zero groups zero, each
    level the nearest to w / d for the stored d), and in every group a squared error at most Q4_0's rule's
    (up to the f16 rounding of d), ~12% less in total on Gaussian weights."""
    w = torch.randn(64, 70) * torch.logspace(-3, 1, 64)[:, None]
    w[0, 32:64] = 0
    q, scale = quantize_int4(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape == (64, 3)
    assert q.min() >= -8 and q.max() <= 7 and not q[0, 32:64].any() and scale[0, 1] == 0
    d = scale.float().repeat_interleave(32, 1)[:, :70]
    assert torch.equal(q, torch.round(w / torch.where(d == 0, 1.0, d)).clamp(-8, 7).to(torch.int8))

    def group_err(q, scale):
        e = (q.float() * scale.float().repeat_interleave(32, 1)[:, :70] - w) ** 2
        return torch.nn.functional.pad(e, (0, 26)).reshape(64, 3, 32).sum(-1)

    mse, q4_0 = group_err(q, scale), group_err(*quantize_int4(w, rule="q4_0"))
    assert bool((mse <= q4_0 * (1 + 2e-3) + 1e-12).all())
    assert mse.sum() < 0.93 * q4_0.sum()
    with pytest.raises(ValueError, match="choose one of"):
        quantize_int4(w, rule="q5")


@pytest.mark.parametrize("rows", [1, 2, 3, 16, 17, 40])
@pytest.mark.parametrize("out_features", [40, 48])
def test_int4_reduced_linear_routes_match_the_dequantized_product(rows, out_features):
    """int4: the block kernel (<= 16 rows), the GEMM over the dequantised weight (more), a slice of a group;
    outputs that are not whole blocks (an LM head) are padded in storage and cut from the result."""
    lin = torch.nn.Linear(70, out_features)
    red = ReducedLinear.from_linears([lin], "int4")
    assert red.blocked and red.weight.dtype == torch.uint8 and red.out_features == out_features
    q, scale = quantize_int4(lin.weight)
    w = q.double() * scale.double().repeat_interleave(32, 1)[:, :70]
    torch.testing.assert_close(red.dequantized(torch.float64), w)
    x = torch.randn(rows, 70)
    with torch.no_grad():
        ref = x.bfloat16().double() @ w.T + lin.bias.double()
        out = red(x)
        assert out.shape == (rows, out_features)
        assert (out.double() - ref).abs().max() < (1e-4 if rows <= 16 else 2e-2) * ref.abs().max()
        if out_features == 48:
            part = red.slice(16, 32)
            assert (part(x).double() - ref[:, 16:32]).abs().max() < (1e-4 if rows <= 16 else 2e-2) * ref.abs().max()
    big = ReducedLinear.from_linears([torch.nn.Linear(512, 256, bias=False)], "int4")
    assert weight_nbytes(torch.nn.Sequential(big)) == 512 * 256 // 2 + 512 // 32 * 256 * 2  # 4.5 bits per weight


@pytest.mark.parametrize("in_features", [32, 70, 512])
@pytest.mark.parametrize("out_features", [16, 40, 3 * 64])
def test_int4_prefill_weight_is_the_former_dequantization_bit_for_bit(in_features, out_features):
    """Prefill (> 16 rows) dequantises int4 blocks into reused buffers (`_int4_gemm_weight`): the same values,
    in f32 and rounded to bf16, as the unpacked levels times their f16 scales, for padded inputs / outputs
    and slices; products of several modules in turn (one buffer) each equal the GEMM over their own weight."""
    from fusedkv.engine.precision import _dequantize_int4, _int4_gemm_weight
    from fusedkv.kernels import cpu_gemv

    torch.manual_seed(in_features + out_features)
    lin = torch.nn.Linear(in_features, out_features, bias=False)
    red = ReducedLinear.from_linears([lin], "int4")
    old = _dequantize_int4(*cpu_gemv.from_int4_blocks(red.weight, red.scale))[:out_features, :in_features]
    for dtype in (torch.float32, torch.bfloat16):
        got = _int4_gemm_weight(red.weight, red.scale, in_features, out_features, dtype)
        assert got.shape == (out_features, in_features) and got.dtype == dtype
        assert torch.equal(got, old.to(dtype))
    if out_features % 32 == 0:
        part = red.slice(16, out_features - 16)
        assert torch.equal(part.dequantized(torch.float32), old[16:out_features - 16])
    other = ReducedLinear.from_linears([torch.nn.Linear(96, 2 * out_features, bias=False)], "int4")
    x, y = torch.randn(40, in_features), torch.randn(40, 96)
    with torch.no_grad():
        for mod, inp in ((red, x), (other, y), (red, x)):
            gemm = mod.gemm_dtype or torch.float32
            want = torch.nn.functional.linear(inp.to(gemm), mod.dequantized(gemm)).float()
            torch.testing.assert_close(mod(inp), want, rtol=1e-5, atol=1e-5)  # the layout may reorder the sums


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 17, 40])
@pytest.mark.parametrize("selected", [False, True])
def test_every_kernel_route_matches_the_dequantized_product(fmt, rows, selected):
    """GEMV kernel (few rows), oneDNN / dequantised GEMM (many rows), with a bias: the portable products and
    the ones the runtime selects for this processor (`fusedkv.engine.selection.select_products`)."""
    lin = torch.nn.Linear(48, 40)
    red = ReducedLinear.from_linears([lin], fmt)
    if selected:
        select_products(red)
    x = torch.randn(rows, 48)
    ref = x @ red.dequantized(torch.float64).T.float() + lin.bias
    out = red(x)
    assert out.shape == (rows, 40) and out.dtype == torch.float32
    assert (out - ref).abs().max() < (3e-2 if fmt != "float16" else 3e-3) * ref.abs().max()


def test_weight_bytes_and_layout_requests():
    model = _trained_like("fusedkv-lite")
    full = weight_nbytes(model)
    ids = torch.randint(1, 97, (1, 8))
    with torch.no_grad():
        before = reduce_precision(model, "int8")(ids).logits
    assert weight_nbytes(model) < full / 3.5  # int8 + one 16-bit scale per output channel
    set_decode_layout(model, "packed")  # the reduced modules keep their own layout: no-ops
    unpack_weights(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    assert torch.equal(generate(model, ids, 4).tokens, generate(model, ids, 4, weight_layout="auto").tokens)


def test_formats_and_errors():
    assert weight_format("bf16") == "bfloat16" and weight_format("q8") == "int8"
    assert weight_format("half") == str(half_dtype()).removeprefix("torch.")
    assert int8_activation_dtype() in (torch.bfloat16, torch.float16, torch.float32)
    assert weight_format("q4") == "int4"
    with pytest.raises(ValueError, match="choose one of"):
        weight_format("int3")
    model = tiny_model("vanilla")
    assert reduce_precision(model, "float32") is model
    reduce_precision(model, "bfloat16")
    with pytest.raises(ValueError, match="already reduced"):
        reduce_precision(model, "int8")


@pytest.mark.parametrize("fmt, head, expected", [("int4", None, "int8"), ("int4", "int4", "int4"),
                                                  ("int4", "bf16", "bfloat16"), ("int8", None, "int8"),
                                                  ("bfloat16", None, "bfloat16"), ("float32", "int8", "int8")])
def test_lm_head_format(fmt, head, expected):
    """int4 keeps the LM head at int8 unless told otherwise (llama.cpp's Q4 files keep theirs at 6 bits);
    other formats reduce it like every projection; an f32 head stays the model's own nn.Linear."""
    assert head_format(fmt, head) == expected
    model = reduce_precision(tiny_model("vanilla"), fmt, head)
    lm_head, proj = model.get_output_embeddings(), model.model.layers[0].mlp.down_proj
    assert isinstance(lm_head, ReducedLinear) and lm_head.fmt == expected and model.reduced_head == expected
    assert (proj.fmt == fmt) if fmt != "float32" else not isinstance(proj, ReducedLinear)
    kept = reduce_precision(tiny_model("vanilla"), "int4", "float32").get_output_embeddings()
    assert type(kept) is torch.nn.Linear
    with pytest.raises(ValueError, match="choose one of"):
        head_format("int4", "int3")


def test_int8_head_under_int4_is_the_int8_product():
    """The default int4 model's logits are its last hidden state times the int8-quantised head, exactly as an
    int8 `ReducedLinear` of the f32 head computes them (nothing else of the head is rounded)."""
    ref = tiny_model("vanilla")
    model = reduce_precision(copy.deepcopy(ref), "int4")
    int8_head = ReducedLinear.from_linears([ref.get_output_embeddings()], "int8")
    ids = torch.randint(1, 97, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state
        torch.testing.assert_close(model(ids).logits, int8_head(hidden), rtol=0, atol=0)


# A 16-bit KV cache under f32 activations (StaticKVCache dtype): decode against the f32 full forward.
KV_TOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3}


@pytest.mark.parametrize("plan", ["vanilla", "fusedkv-lite", "fusedkv"])
@pytest.mark.parametrize("kv_dtype", list(KV_TOL))
def test_16bit_kv_cache_decode_matches_f32_full_forward(plan, kv_dtype):
    model = _trained_like(plan)
    ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(4))
    cache = StaticKVCache(model.config, 2, 20, kv_dtype)
    with torch.no_grad():
        steps = [model(ids[:, :6], cache=cache, use_cache=True).logits]
        steps += [model(ids[:, t:t + 1], cache=cache, use_cache=True).logits for t in range(6, 12)]
        full = model(ids).logits
    dec = torch.cat(steps, 1)
    assert dec.dtype == torch.float32 and all(t.dtype == kv_dtype for t in cache.keys.values())
    assert 0 < _rel(dec, full) < KV_TOL[kv_dtype]


def test_16bit_cache_stacks_with_reduced_weights_and_half_size_plans():
    ids = torch.randint(1, 97, (1, 8))
    bytes_ = {}
    for plan in ("vanilla", "fusedkv-lite"):
        for kv in (torch.float32, torch.bfloat16):
            model = reduce_precision(_trained_like(plan), "int8")
            r = generate(model, ids, 5, cache_factory=lambda c, b, n, d, dev, kv=kv: StaticKVCache(c, b, n, kv, dev))
            bytes_[plan, kv] = r.cache_bytes
            assert r.tokens.shape == (1, 13)
    assert bytes_["fusedkv-lite", torch.bfloat16] * 4 == bytes_["vanilla", torch.float32]
    with pytest.raises(ValueError, match="floating dtype"):
        StaticKVCache(tiny_model("vanilla").config, 1, 8, torch.int8)
