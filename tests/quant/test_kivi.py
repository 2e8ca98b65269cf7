"""KIVI cache: the quantiser's error bound, bit packing, the residual-window schedule, decode against
an independent fake-quantising reference, bytes against the closed form, and bad settings."""

import pytest
import torch
from transformers.cache_utils import Cache, DummyLayer

from fusedkv.cache import kv_cache_nbytes
from fusedkv.generation import generate
from fusedkv.quant import KIVICache, kivi_cache_factory, kivi_cache_nbytes
from fusedkv.quant.kivi import KIVILayer
from fusedkv.quant.kivi_codes import (
    dequantize,
    pack_codes,
    quantize_keys,
    quantize_values,
    unpack_codes,
)
from tests.conftest import tiny_model

# --- an independent reference: per-group min/max written out group by group ----------------------


def _ref_fake_quant_groups(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x [..., n] -> each row quantised with its own min/max (fp16 scale and zero, as stored)."""
    qmax = 2**bits - 1
    lo, hi = x.min(-1, keepdim=True).values, x.max(-1, keepdim=True).values
    scale = ((hi - lo) / qmax).half().to(x.dtype)
    zero = lo.half().to(x.dtype)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.clamp(torch.round((x - zero) / safe), 0, qmax) * scale + zero


def ref_keys(k: torch.Tensor, bits: int, g: int) -> torch.Tensor:
    """Per channel, groups of g tokens."""
    out = torch.empty_like(k)
    for start in range(0, k.shape[2], g):
        block = k[:, :, start:start + g]  # [B, H, g, D]: one group per channel
        out[:, :, start:start + g] = _ref_fake_quant_groups(block.transpose(2, 3), bits).transpose(2, 3)
    return out


def ref_values(v: torch.Tensor, bits: int, g: int) -> torch.Tensor:
    """Per token, groups of g channels."""
    out = torch.empty_like(v)
    for start in range(0, v.shape[3], g):
        out[..., start:start + g] = _ref_fake_quant_groups(v[..., start:start + g], bits)
    return out


class ReferenceKIVICache(Cache):
    """Keeps the full-precision history and, at each update, returns what KIVI's schedule implies,
    quantising from scratch: keys[: R*floor(past/R)] and values[: past - R] quantised, the rest exact."""

    def __init__(self, config, bits, g, r):
        super().__init__(layers=[DummyLayer() for _ in range(config.num_hidden_layers)])
        self.bits, self.g, self.r = bits, g, r
        self.history: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.first = min(config.plan.storage_layers)

    def get_seq_length(self, layer_idx=0):
        return self.history[self.first][0].shape[2] if self.first in self.history else 0

    def update(self, k, v, layer_idx, *args, **kwargs):
        past = self.history[layer_idx][0].shape[2] if layer_idx in self.history else 0
        if past:
            k = torch.cat([self.history[layer_idx][0], k], 2)
            v = torch.cat([self.history[layer_idx][1], v], 2)
        self.history[layer_idx] = (k, v)
        nk, nv = (past // self.r) * self.r, max(past - self.r, 0)
        k_out = torch.cat([ref_keys(k[:, :, :nk], self.bits, self.g), k[:, :, nk:]], 2)
        v_out = torch.cat([ref_values(v[:, :, :nv], self.bits, self.g), v[:, :, nv:]], 2)
        return k_out, v_out


# --- the quantiser --------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_round_trip_error_within_the_bound_of_the_bit_width(bits, axis):
    g = 8
    x = torch.randn(2, 3, 32, 16) * 3 + torch.randn(1, 1, 1, 16) * 5  # channel offsets, like real keys
    q = quantize_keys(x, bits, g) if axis == "channel" else quantize_values(x, bits, g)
    err = (dequantize(q) - x).abs()
    # the bound per group: half a step, plus the fp16 rounding of scale and zero
    grouped = x.view(2, 3, 4, g, 16).transpose(3, 4) if axis == "channel" else x.view(2, 3, 32, 2, g)
    lo, hi = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    step = (hi - lo) / (2**bits - 1)
    bound = step / 2 + 2**-10 * (lo.abs() + hi.abs()) + 1e-6
    err_grouped = err.view(2, 3, 4, g, 16).transpose(3, 4) if axis == "channel" else err.view(2, 3, 32, 2, g)
    assert bool((err_grouped <= bound).all())
    assert err.max() > step.min() / 8  # it really quantised
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (2, 3, 32, 16 * bits // 8)
    assert q.scale.dtype == q.zero.dtype == torch.float16
    assert q.scale.shape == ((2, 3, 4, 16) if axis == "channel" else (2, 3, 32, 2))
    ref = ref_keys(x, bits, g) if axis == "channel" else ref_values(x, bits, g)
    torch.testing.assert_close(dequantize(q), ref, rtol=0, atol=1e-6)


def test_constant_groups_are_exact_and_more_bits_are_more_accurate():
    x = torch.full((1, 1, 8, 8), 0.75)
    assert torch.equal(dequantize(quantize_keys(x, 2, 8)), x)
    y = torch.randn(1, 2, 64, 32)
    e2 = (dequantize(quantize_values(y, 2, 32)) - y).abs().mean()
    e4 = (dequantize(quantize_values(y, 4, 32)) - y).abs().mean()
    assert e4 < e2 / 3


@pytest.mark.parametrize("bits", [2, 4])
def test_packing_round_trips_and_packs_8_over_bits_per_byte(bits):
    codes = torch.randint(0, 2**bits, (3, 5, 16), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (3, 5, 16 * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)
    # the first code sits in the lowest bits
    assert int(packed[0, 0, 0]) & (2**bits - 1) == int(codes[0, 0, 0])


# --- the residual window ----------------------------------------------------------------------------


def test_residual_tokens_are_exact_and_the_schedule_is_kivis():
    g, r, bits = 4, 8, 2
    layer = KIVILayer(bits, g, r)
    k_all, v_all = torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    chunks = [11, 1, 1, 1, 1, 1, 5, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    pos = 0
    for n in chunks:
        past = pos
        k, v = layer.update(k_all[:, :, pos:pos + n], v_all[:, :, pos:pos + n])
        pos += n
        nk, nv = (past // r) * r, max(past - r, 0)
        assert k.shape[2] == v.shape[2] == pos
        assert torch.equal(k[:, :, nk:], k_all[:, :, nk:pos])  # the residual window: bit-exact
        assert torch.equal(v[:, :, nv:], v_all[:, :, nv:pos])
        torch.testing.assert_close(k[:, :, :nk], ref_keys(k_all[:, :, :nk], bits, g), rtol=0, atol=1e-6)
        torch.testing.assert_close(v[:, :, :nv], ref_values(v_all[:, :, :nv], bits, g), rtol=0, atol=1e-6)
        # after the flush: keys keep < R tokens, values exactly the last min(pos, R)
        assert layer.keys.shape[2] == pos % r and layer.values.shape[2] == min(pos, r)
        assert layer.get_seq_length() == pos


# --- decode against the reference, every kind of plan ----------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["vanilla", "fusedkv", "fusedkv-lite", "cla", "fusedkv-gqa"])
@pytest.mark.parametrize("bits", [2, 4])
def test_decode_matches_a_reference_that_quantises_the_same_way(plan, bits):
    model = tiny_model(plan)
    g, r = 4, 8
    ids = torch.randint(1, 97, (2, 37))
    prompt = 13

    def run(cache):
        logits = [model(ids[:, :prompt], cache=cache, use_cache=True).logits[:, -1]]
        for t in range(prompt, ids.shape[1]):
            logits.append(model(ids[:, t:t + 1], cache=cache, use_cache=True).logits[:, -1])
        return torch.stack(logits, 1)

    with torch.no_grad():
        ours = run(KIVICache(model.config, bits, g, r))
        ref = run(ReferenceKIVICache(model.config, bits, g, r))
        full = model(ids).logits[:, prompt - 1:]
    assert (ours - ref).abs().max() < 1e-5
    assert (ours - full).abs().max() > 1e-3  # the quantisation is real
    torch.testing.assert_close(ours[:, 0], full[:, 0], rtol=0, atol=1e-5)  # prefill attends in full precision


def test_generate_paths_agree_and_bytes_match_the_formula():
    model = tiny_model("fusedkv")
    ids = torch.randint(1, 97, (2, 9))
    cache = KIVICache(model.config, 4, 4, 8)
    with torch.no_grad():
        hf = model.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=0, cache=cache)
    lean = generate(model, ids, 30, cache_factory=kivi_cache_factory(4, 4, 8))
    assert torch.equal(lean.tokens, hf)
    n = hf.shape[1] - 1  # the last token is sampled, never stored
    assert cache.get_seq_length() == n
    formula = kivi_cache_nbytes(model.config, n, 2, 4, 4, 8)
    assert lean.cache_bytes == kv_cache_nbytes(cache) == cache.nbytes() == formula


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 31, 64, 65])
def test_measured_bytes_equal_the_formula(bits, n):
    model = tiny_model("fusedkv", num_key_value_heads=2)
    cache = KIVICache(model.config, bits, group_size=8, residual_length=16)
    with torch.no_grad():
        model(torch.randint(1, 97, (3, n)), cache=cache, use_cache=True)
        model(torch.randint(1, 97, (3, 1)), cache=cache, use_cache=True)
    measured = cache.nbytes()
    assert measured == kivi_cache_nbytes(model.config, n + 1, 3, bits, 8, 16)
    # by hand for the first storage layer: codes, fp16 scale+zero, fp32 residual
    layer = cache.layers[0]
    qk = ((n + 1) // 16) * 16
    qv = max(n + 1 - 16, 0)
    by_hand = 3 * 2 * (qk * 16 * bits // 8 + qk // 8 * 16 * 4 + (n + 1 - qk) * 16 * 4
                       + qv * 16 * bits // 8 + qv * 2 * 4 + (n + 1 - qv) * 16 * 4)
    assert sum(t.numel() * t.element_size() for t in layer.tensors()) == by_hand
    assert measured == by_hand * len(model.config.plan.storage_layers)


def test_long_cache_is_near_the_payload_ratio():
    model = tiny_model("fusedkv", head_dim=32, hidden_size=128, max_position_embeddings=1024)
    cache = KIVICache(model.config, 4, group_size=32, residual_length=32)
    with torch.no_grad():
        out = model(torch.randint(1, 97, (1, 1024)), use_cache=True)
        model(torch.randint(1, 97, (1, 1024)), cache=cache, use_cache=True)
    fp32 = kv_cache_nbytes(out.cache)
    # 4-bit codes + 2x16-bit per 32 elements = 5 bits vs 32 bits, plus at most a window in fp32
    assert 5 / 32 <= cache.nbytes() / fp32 < 5 / 32 + 2 * 32 / 1024


# --- bad settings ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    (dict(bits=3), "supports 2 or 4 bits"),
    (dict(bits=8), "supports 2 or 4 bits"),
    (dict(group_size=6), "does not divide the head dimension 16"),
    (dict(group_size=4, residual_length=6), "multiple of the group size"),
    (dict(group_size=4, residual_length=0), "multiple of the group size"),
    (dict(group_size=0), "positive"),
])
def test_bad_settings_are_one_line_errors(kwargs, message):
    model = tiny_model("fusedkv")
    settings = dict(bits=4, group_size=4, residual_length=8) | kwargs
    with pytest.raises(ValueError, match=message):
        KIVICache(model.config, **settings)


def test_left_padded_batches_agree_between_generate_paths():
    model = tiny_model("fusedkv-lite")
    ids = torch.randint(1, 97, (2, 11))
    mask = torch.ones_like(ids)
    ids[0, :4], mask[0, :4] = 0, 0
    cache = KIVICache(model.config, 2, 4, 8)
    cache.set_padding(mask)  # what fusedkv.generation.generate does: rows quantised as if alone
    with torch.no_grad():
        hf = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0,
                            cache=cache)
    lean = generate(model, ids, 20, attention_mask=mask, cache_factory=kivi_cache_factory(2, 4, 8))
    assert torch.equal(lean.tokens, hf)
