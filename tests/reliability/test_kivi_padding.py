"""The KIVI cache does not depend on padding (#9): a left-padded row decodes exactly as the same prompt
alone, logits and greedy tokens, at 2 and 4 bits, for every plan. Was: pad positions joined the per-channel
key min/max groups and the groups followed the padded columns (max logit difference 3.75 at 2 bits)."""

import pytest
import torch

from fusedkv.generation import generate
from fusedkv.quant import KIVICache, kivi_cache_factory
from tests.conftest import PLAN_CONFIGS, tiny_model

G, R = 4, 8  # small groups and window, so the prompt and the decode cross several flushes
NEW = 20


def _batch(alone: torch.Tensor, other: torch.Tensor):
    """`alone` left-padded beside the longer `other`: ids and mask."""
    pad = other.shape[0] - alone.shape[0]
    ids = torch.stack([torch.cat([torch.zeros(pad, dtype=torch.long), alone]), other])
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    return ids, mask


def _teacher_forced_logits(model, ids, mask, cache, forced: torch.Tensor) -> torch.Tensor:
    """Last-position logits of the prefill, then of one-token steps feeding `forced` [B, n]."""
    steps = [model(ids, attention_mask=mask, cache=cache, use_cache=True).logits[:, -1]]
    for t in range(forced.shape[1]):
        mask = None if mask is None else torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        steps.append(model(forced[:, t:t + 1], attention_mask=mask, cache=cache, use_cache=True).logits[:, -1])
    return torch.stack(steps, 1)


# The fast tier: a plain cache, one with fused sources and the iterative chain; every plan in the full suite.
FAST_PLANS = ("vanilla", "fusedkv", "fusedkv-iterative")


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("plan", [pytest.param(p, marks=() if p in FAST_PLANS else pytest.mark.slow)
                                  for p in PLAN_CONFIGS])
def test_a_left_padded_row_decodes_as_the_prompt_alone(plan, bits):
    model = tiny_model(plan, dtype=torch.float64)  # float64: batched and single-row K/V agree to ~1e-15
    g = torch.Generator().manual_seed(1)
    prompt, other = torch.randint(1, 97, (1, 13), generator=g), torch.randint(1, 97, (1, 19), generator=g)
    ids, mask = _batch(prompt[0], other[0])
    with torch.no_grad():
        alone = generate(model, prompt, NEW, cache_factory=kivi_cache_factory(bits, G, R)).tokens[0]
        batched = generate(model, ids, NEW, attention_mask=mask, cache_factory=kivi_cache_factory(bits, G, R)).tokens
        assert torch.equal(batched[0, 6:], alone)  # greedy tokens
        forced = torch.stack([alone[13:], batched[1, 19:]])
        ref = _teacher_forced_logits(model, prompt, None, KIVICache(model.config, bits, G, R), forced[:1])
        cache = KIVICache(model.config, bits, G, R)
        cache.set_padding(mask)
        got = _teacher_forced_logits(model, ids, mask, cache, forced)
        full = model(torch.cat([prompt, forced[:1]], 1)).logits[0, 12:]
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-9)  # logits, every step
    assert (ref[0] - full).abs().max() > 1e-3  # the quantisation is real
    # The padded row stores its real tokens only: as many bytes as the prompt alone.
    alone_cache = KIVICache(model.config, bits, G, R)
    with torch.no_grad():
        _teacher_forced_logits(model, prompt, None, alone_cache, forced[:1])
    layer = next(layer for layer in cache.layers if hasattr(layer, "rows"))
    alone_layer = next(layer for layer in alone_cache.layers if hasattr(layer, "rows"))
    assert sum(t.numel() * t.element_size() for t in layer.rows[0].tensors()) == \
        sum(t.numel() * t.element_size() for t in alone_layer.tensors())


def test_set_padding_refuses_right_padding_and_late_calls():
    model = tiny_model("fusedkv")
    cache = KIVICache(model.config, 4, G, R)
    with pytest.raises(ValueError, match="left padding only"):
        cache.set_padding(torch.tensor([[1, 1, 0], [1, 1, 1]]))
    with torch.no_grad():
        model(torch.randint(1, 97, (2, 3)), cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="before the prompt"):
        cache.set_padding(torch.tensor([[0, 1, 1], [1, 1, 1]]))
