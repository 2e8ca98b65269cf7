"""The lean, timed generation loop agrees with transformers' generate() and with itself across caches."""

import pytest
import torch

from fusedkv.generation import generate, sample_next
from tests.conftest import tiny_model


@pytest.mark.parametrize("plan", ["vanilla", "fusedkv-lite", "fusedkv", "cla"])
def test_lean_loop_matches_hf_generate_with_left_padding(plan):
    model = tiny_model(plan)
    ids = torch.randint(1, 97, (2, 9))
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=0)
    for static in (True, False):
        out = generate(model, ids, 7, attention_mask=mask, static_cache=static)
        assert torch.equal(out.tokens, ref)
        assert len(out.step_s) == 6 and out.ttft_s > 0
    assert out.cache_bytes > 0


def test_eos_stops_and_context_limit_is_checked():
    model = tiny_model("fusedkv")
    ids = torch.randint(1, 97, (1, 5))
    first = generate(model, ids, 3).tokens[0, 5].item()
    stopped = generate(model, ids, 20, eos_token_id=first)
    assert stopped.tokens.shape[1] == 6  # the first new token was EOS: nothing after it
    with pytest.raises(ValueError, match="max_position_embeddings=128"):
        generate(model, torch.randint(1, 97, (1, 120)), 20)


def test_sampling_respects_top_k():
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0]])
    g = torch.Generator().manual_seed(0)
    picks = {sample_next(logits, temperature=1.0, top_k=2, generator=g).item() for _ in range(50)}
    assert picks <= {1, 2} and sample_next(logits).item() == 1
