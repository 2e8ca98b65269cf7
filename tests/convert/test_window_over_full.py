"""Qwen2/Qwen3 with `use_sliding_window: true` and `max_window_layers = L/2`: transformers makes the lower half
full attention and the upper half windowed. Every half-split plan then has window layers reading the lower
full layers' caches (their own mask applies the window): the vanilla import equals transformers, and each
plan's incremental decode (dynamic and static caches, every attention path) equals its own full forward on
prompts longer than the window."""

from __future__ import annotations

import pytest
import torch
import transformers

from fusedkv.cache import StaticKVCache
from fusedkv.convert import convert_checkpoint
from fusedkv.engine import select_runtime
from fusedkv.generation import generate
from fusedkv.plan import FULL, SLIDING
from tests.conftest import randomize_fusion
from tests.model.test_decode import incremental_logits, padded_batch

WINDOW = 5
SHAPE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.1,
             use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2, pad_token_id=0,
             bos_token_id=None, eos_token_id=None)


@pytest.fixture(scope="module", params=["Qwen2", "Qwen3"])
def source(request, tmp_path_factory):
    torch.manual_seed(0)
    config = getattr(transformers, f"{request.param}Config")(**SHAPE)
    config._attn_implementation = "eager"
    model = getattr(transformers, f"{request.param}ForCausalLM")(config).eval()
    path = tmp_path_factory.mktemp(request.param) / "src"
    model.save_pretrained(path)
    return path, model


def test_vanilla_import_equals_transformers(source, tmp_path):
    path, reference = source
    ours = convert_checkpoint(path, tmp_path / "vanilla").eval()
    assert ours.config.layer_types == [FULL, FULL, SLIDING, SLIDING]
    ids = torch.randint(1, 97, (1, 4 * WINDOW))
    with torch.no_grad():
        assert (ours(ids).logits - reference(ids).logits).abs().max() < 1e-5


@pytest.mark.parametrize("plan", ["fusedkv", "fusedkv-lite", "yoco"])
def test_window_layers_read_full_caches_and_decode_as_the_full_forward(source, tmp_path, plan):
    path, _ = source
    model = convert_checkpoint(path, tmp_path / plan, kv_sharing=plan).eval()
    assert model.plan.reconstruction_layers == (2, 3)
    assert {model.plan.layers[s].attention_type for i in (2, 3) for s in model.plan.layers[i].sources} == {FULL}
    randomize_fusion(model, 0)
    ids, mask, width = padded_batch(3 * WINDOW)
    paths = ("auto", "materialized", "factored") if plan == "fusedkv" else ("auto",)
    with torch.no_grad():
        for runtime in paths:
            select_runtime(model, runtime)
            full = model(ids, attention_mask=mask, use_cache=False).logits
            for cache in (None, StaticKVCache(model.config, 2, ids.shape[1])):
                steps, _ = incremental_logits(model, ids, mask, width, cache=cache)
                assert (torch.cat(steps, 1) - full)[mask.bool()].abs().max() < 1e-4, runtime
        seq = ids[:1, :3 * WINDOW]
        for _ in range(6):  # greedy over full forwards, against generate's caches and skipped prefill
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1:].argmax(-1)], 1)
        assert torch.equal(generate(model, ids[:1, :3 * WINDOW], 6).tokens, seq)
