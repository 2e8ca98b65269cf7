"""Incremental decode with the compact cache equals the full forward, for every plan (fp32, random
weights, left-padded batches), and prefill skipping changes nothing but the work done."""

import pytest
import torch

from fusedkv.cache import StaticKVCache, kv_cache_nbytes
from fusedkv.engine import select_runtime
from tests.conftest import PLAN_CONFIGS, tiered, tiny_model

NEW_TOKENS = 5
PATHS = ["auto", "materialized", "factored"]
# The fast tier runs every plan at one prompt length, and the other lengths for two plans (a stored and a fused
# one); the full suite runs every combination.
ANCHORS = ("vanilla", "fusedkv")


def padded_batch(prompt_len: int, pad: int = 2, vocab: int = 97, seed: int = 1):
    """Row 0: `pad` pad tokens then `prompt_len` real ones; row 1: prompt_len + pad real tokens."""
    g = torch.Generator().manual_seed(seed)
    width = prompt_len + pad
    ids = torch.randint(1, vocab, (2, width + NEW_TOKENS), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :pad], mask[0, :pad] = 0, 0
    return ids, mask, width


def incremental_logits(model, ids, mask, width, keep_last=0, cache=None):
    """Prefill the prompt, then feed the continuation one token at a time."""
    out = model(ids[:, :width], attention_mask=mask[:, :width], use_cache=True, logits_to_keep=keep_last,
                cache=cache)
    cache, steps = out.cache, [out.logits]
    for t in range(width, ids.shape[1]):
        out = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache, use_cache=True)
        cache = out.cache
        steps.append(out.logits)
    return steps, cache


@pytest.mark.parametrize("plan_name, path, prompt_len", tiered(
    [(plan, path, n) for plan in PLAN_CONFIGS for path in PATHS for n in (1, 7, 33)],
    lambda plan, path, n: n == 7 or plan in ANCHORS))
def test_incremental_decode_matches_full_forward(plan_name, prompt_len, path):
    model = tiny_model(plan_name)
    select_runtime(model, path)
    ids, mask, width = padded_batch(prompt_len)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        steps, _ = incremental_logits(model, ids, mask, width)
    valid = mask[:, :width].bool()
    assert (steps[0] - full[:, :width])[valid].abs().max() < 1e-4
    for k, step in enumerate(steps[1:]):
        assert (step[:, 0] - full[:, width + k]).abs().max() < 1e-4


@pytest.mark.parametrize("plan_name, prompt_len", tiered(
    [(plan, n) for plan in PLAN_CONFIGS for n in (1, 7, 33)], lambda plan, n: n == 7 or plan in ANCHORS))
def test_prefill_skipping_gives_full_forward_last_logits(plan_name, prompt_len):
    model = tiny_model(plan_name)
    ids, mask, width = padded_batch(prompt_len)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        steps, _ = incremental_logits(model, ids, mask, width, keep_last=1)
    assert steps[0].shape[1] == 1
    assert (steps[0][:, 0] - full[:, width - 1]).abs().max() < 1e-4
    for k, step in enumerate(steps[1:]):  # decoding after a skipped prefill is unaffected
        assert (step[:, 0] - full[:, width + k]).abs().max() < 1e-4


def test_prefill_skipping_really_skips_upper_layers():
    model = tiny_model("fusedkv")
    seen = []
    hooks = [layer.mlp.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[1]))
             for layer in model.model.layers]
    ids = torch.randint(1, 97, (1, 20))
    with torch.no_grad():
        model(ids, use_cache=True, logits_to_keep=1)
    for h in hooks:
        h.remove()
    assert seen == [20, 20, 1, 1]  # lower half over the prompt, upper half only for the last position


def test_static_cache_matches_dynamic():
    model = tiny_model("fusedkv")
    ids, mask, width = padded_batch(7)
    cache = StaticKVCache(model.config, batch_size=2, max_len=64)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        steps, cache = incremental_logits(model, ids, mask, width, keep_last=1, cache=cache)
    for k, step in enumerate(steps[1:]):
        assert (step[:, 0] - full[:, width + k]).abs().max() < 1e-4
    assert cache.get_seq_length() == ids.shape[1]
    assert kv_cache_nbytes(cache) == 2 * 2 * 2 * 4 * 64 * 16 * 4  # storage layers x K,V x B x H x S x D x fp32


def test_generate_greedy_equals_manual_loop_and_sampling_runs():
    model = tiny_model("fusedkv")
    ids = torch.randint(1, 97, (1, 6))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        manual = ids
        for _ in range(8):
            nxt = model(manual, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            manual = torch.cat([manual, nxt], dim=1)
        assert torch.equal(out, manual)
        torch.manual_seed(0)
        sampled = model.generate(ids, max_new_tokens=8, do_sample=True, top_k=20, temperature=0.8, pad_token_id=0)
    assert sampled.shape == (1, 14)


def test_generate_left_padded_batch_matches_unpadded():
    model = tiny_model("fusedkv-lite")
    ids, mask, width = padded_batch(7)
    with torch.no_grad():
        batch_out = model.generate(ids[:, :width], attention_mask=mask[:, :width], max_new_tokens=6,
                                   do_sample=False, pad_token_id=0)
        alone = model.generate(ids[:1, 2:width], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(batch_out[0, 2:], alone[0])


PLAN_HALF = ["cla", "yoco", "fusedkv-lite", "fusedkv", "fusedkv-dense", "reversed"]


def test_measured_cache_bytes():
    sizes = {}
    ids = torch.randint(1, 97, (2, 10))
    for plan in ["vanilla", "gqa", *PLAN_HALF]:
        model = tiny_model(plan)
        with torch.no_grad():
            seq = torch.cat([ids, ids[:, :5]], 1)
            _, cache = incremental_logits(model, seq, torch.ones(2, 15, dtype=torch.long), 10)
        sizes[plan] = kv_cache_nbytes(cache)
    vanilla = sizes["vanilla"]
    assert vanilla == 2 * 4 * 2 * 4 * 15 * 16 * 4  # K,V x layers x B x H x S x D x fp32 bytes
    for plan in ["gqa", *PLAN_HALF]:
        assert sizes[plan] / vanilla == 0.5, plan


@pytest.mark.parametrize("plan_name, prompt_len", tiered(
    [(plan, n) for plan in PLAN_CONFIGS for n in (7, 33)], lambda plan, n: n == 7 or plan in ANCHORS))
def test_unpadded_prompt_paths_agree(plan_name, prompt_len):
    """Without a padding mask the model uses SDPA's causal flag; every path must agree with it."""
    model = tiny_model(plan_name)
    ids = torch.randint(1, 97, (2, prompt_len + 3))
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits
        for path in ("factored", "auto"):
            select_runtime(model, path)
            assert (model(ids, use_cache=False).logits - reference).abs().max() < 1e-4
            out = model(ids[:, :prompt_len], use_cache=True, logits_to_keep=1)
            cache = out.cache
            for t in range(prompt_len, prompt_len + 3):
                step = model(ids[:, t : t + 1], cache=cache, use_cache=True).logits
                assert (step[:, 0] - reference[:, t]).abs().max() < 1e-4


TRITON_SCRIPT = """
import torch
import tests.kernels._triton_interpreter  # the interpreter without its repeated set-up
from tests.conftest import tiny_model
from tests.model.test_decode import padded_batch, incremental_logits
from fusedkv.engine import select_runtime
for plan in ("fusedkv", "fusedkv-lite", "fusedkv-gqa"):
    model = tiny_model(plan)
    ids, mask, width = padded_batch(7)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        select_runtime(model, "triton")  # one-token decode steps run the Triton kernel
        steps, _ = incremental_logits(model, ids[:, :width + 2], mask[:, :width + 2], width, keep_last=1)
    for k, step in enumerate(steps[1:]):
        err = (step[:, 0] - full[:, width + k]).abs().max().item()
        assert err < 1e-4, (plan, err)
print("ok")
"""


@pytest.mark.slow
def test_triton_decode_path_in_the_model_under_the_interpreter():
    import os
    import subprocess
    import sys

    from fusedkv.kernels import is_triton_available

    if not is_triton_available():
        pytest.skip("triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
