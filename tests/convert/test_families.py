"""Import of every dense family `fusedkv convert` knows, checked against transformers' own classes.

Each case builds a tiny random checkpoint with the family's transformers class, saves it with
`save_pretrained` (some sharded), converts it as vanilla and checks: logits within 1e-5 of transformers' on a
left-padded batch of 2 whose prompts are longer than any sliding window; 32 greedy tokens equal (fusedkv's
`generate` and transformers' `generate`); the round trip through `save_pretrained` / `from_pretrained`; and
that a half-cache plan on top builds and runs.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from fusedkv import FusedKVForCausalLM
from fusedkv.convert import convert_checkpoint
from fusedkv.generation import generate

VOCAB = 101
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.1,
             bos_token_id=None, eos_token_id=None, pad_token_id=0)
WINDOW = 8  # prompts below are 19 and 13 real tokens: longer than the window
SLIDE, FULL = "sliding_attention", "full_attention"

# (case id, transformers causal-LM class, config class, config fields, save_pretrained max_shard_size)
CASES = [
    ("llama", "LlamaForCausalLM", "LlamaConfig", {}, None),
    ("llama-bias-tied-llama3", "LlamaForCausalLM", "LlamaConfig", dict(
        attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}), None),
    ("llama-linear-sharded", "LlamaForCausalLM", "LlamaConfig", dict(
        rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_theta=10000.0), "60KB"),
    ("llama-dynamic", "LlamaForCausalLM", "LlamaConfig", dict(
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}), None),
    ("llama-gelu", "LlamaForCausalLM", "LlamaConfig", dict(hidden_act="gelu_new"), None),
    ("llama-yarn", "LlamaForCausalLM", "LlamaConfig", dict(  # YaRN: attention scaling of cos/sin != 1
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32}), None),
    ("qwen2", "Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=True), None),
    ("qwen2-window-sharded", "Qwen2ForCausalLM", "Qwen2Config", dict(
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), "60KB"),
    ("mistral-window", "MistralForCausalLM", "MistralConfig", dict(sliding_window=WINDOW), None),
    ("mistral-no-window", "MistralForCausalLM", "MistralConfig", dict(sliding_window=None), None),
    ("qwen3-window", "Qwen3ForCausalLM", "Qwen3Config", dict(
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), None),
    ("qwen3-layer-types-gelu", "Qwen3ForCausalLM", "Qwen3Config", dict(
        sliding_window=WINDOW, use_sliding_window=True, layer_types=[SLIDE, FULL, SLIDE, FULL],
        hidden_act="gelu"), None),
    ("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        sliding_window=WINDOW, layer_types=[SLIDE, SLIDE, FULL, SLIDE], query_pre_attn_scalar=24,
        final_logit_softcapping=3.0,
        rope_parameters={FULL: {"rope_type": "default", "rope_theta": 1e6},
                         SLIDE: {"rope_type": "default", "rope_theta": 1e4}}), "60KB"),
    ("gemma3-linear-global", "Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        sliding_window=WINDOW, sliding_window_pattern=2, attention_bias=True, tie_word_embeddings=False,
        rope_parameters={FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                         SLIDE: {"rope_type": "default", "rope_theta": 1e4}}), None),
    ("gemma2", "Gemma2ForCausalLM", "Gemma2Config", dict(
        sliding_window=WINDOW, query_pre_attn_scalar=32, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        hidden_activation="gelu_pytorch_tanh"), None),
]


def build(case, root):
    """(checkpoint directory, the transformers model) for one case, saved as transformers saves it."""
    name, model_class, config_class, fields, shard = case
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**SHAPE, **fields})
    config._attn_implementation = "eager"  # the plain reference (and Gemma 2's soft-capping needs it)
    model = getattr(transformers, model_class)(config).eval()
    path = root / name
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return path, model


# Cases whose feature another case also brings into the fast tier (the dynamic RoPE: its own test below; GELU:
# qwen3-layer-types-gelu, gemma2; ties: llama-bias-tied-llama3; windows: qwen2-window-sharded, mistral-window,
# qwen3-layer-types-gelu; Gemma 3's linear RoPE: llama-linear-sharded): the full suite's.
FULL_SUITE_ONLY = {"llama-dynamic", "llama-gelu", "qwen2", "mistral-no-window", "qwen3-window", "gemma3-linear-global"}


@pytest.fixture(scope="module", params=[pytest.param(c, id=c[0], marks=pytest.mark.slow if c[0] in FULL_SUITE_ONLY
                                                     else ()) for c in CASES])
def imported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    src, reference = build(request.param, root)
    if request.param[4]:
        assert (src / "model.safetensors.index.json").exists()  # really sharded
    convert_checkpoint(src, root / "vanilla", kv_sharing="vanilla")
    ours = FusedKVForCausalLM.from_pretrained(root / "vanilla").eval()
    return request.param[0], src, reference, ours, root


def left_padded_batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (2, 19), generator=g)
    mask = torch.ones(2, 19, dtype=torch.long)
    ids[1, :6], mask[1, :6] = 0, 0  # row 2: 6 pad tokens on the left, 13 real ones
    return ids, mask


def test_logits_match_transformers_on_a_left_padded_batch(imported):
    _, _, reference, ours, _ = imported
    ids, mask = left_padded_batch()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = reference(ids, attention_mask=mask, position_ids=positions).logits
        got = ours(ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    assert (got[real] - want[real]).abs().max() < 1e-5


def test_greedy_tokens_match_transformers(imported):
    name, _, reference, ours, _ = imported
    ids, mask = left_padded_batch()
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0,
                                  eos_token_id=None)
        theirs_loop = ours.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0,
                                    eos_token_id=None)
    assert torch.equal(theirs_loop, want)
    if name == "llama-dynamic":
        return  # fusedkv's generate stops at max_position_embeddings; covered by the test below
    got = generate(ours, ids, 32, attention_mask=mask).tokens
    assert torch.equal(got, want)


def test_round_trip_through_save_and_load(imported, tmp_path):
    _, _, _, ours, _ = imported
    ours.save_pretrained(tmp_path / "again")
    back = FusedKVForCausalLM.from_pretrained(tmp_path / "again").eval()
    ids, mask = left_padded_batch()
    with torch.no_grad():
        assert torch.equal(back(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits)
    fields = [back.config.to_dict(), ours.config.to_dict()]
    for f in fields:
        f.pop("_name_or_path")
    assert fields[0] == fields[1]


# Plans on top: the window families also take the sliding-window variants (+W shares only the window
# layers, +WF both kinds); a plan must find sources of each shared layer's own attention type below it.
PLANS = {"default": ["fusedkv", "fusedkv-lite+gqa", "yoco"],
         "window": ["fusedkv", "fusedkv+W", "yoco+WF", "fusedkv-lite+gqa"],
         "gemma3": ["fusedkv+W", "cla"]}  # layers S S F S: only the window layers find sources below


def test_a_half_cache_plan_on_top_builds_and_runs(imported):
    name, src, reference, vanilla, root = imported
    windowed = "sliding_attention" in vanilla.config.layer_types
    plans = PLANS.get(name, PLANS["window" if windowed else "default"])
    ids, mask = left_padded_batch()
    for plan in plans:
        model = convert_checkpoint(src, root / plan, kv_sharing=plan, overwrite=True).eval()
        assert model.config.kv_cache_fraction(64) < vanilla.config.kv_cache_fraction(64), plan
        # the storage layers keep the source's weights, the reconstruction layers its queries
        for i, layer in enumerate(model.model.layers):
            assert torch.equal(layer.self_attn.q_proj.weight, reference.model.layers[i].self_attn.q_proj.weight)
            if layer.self_attn.layer.stores:
                assert torch.equal(layer.self_attn.k_proj.weight, reference.model.layers[i].self_attn.k_proj.weight)
        out = generate(model, ids, 4, attention_mask=mask).tokens
        assert out.shape == (2, 23) and torch.isfinite(model(ids, attention_mask=mask).logits).all()
        # ready for continued training: finite gradients, reaching the fusion weights where the plan has any
        model.train()
        model(ids, attention_mask=mask, labels=ids).loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
        assert all(g.abs().sum() > 0 for n, g in grads.items() if ".fusion." in n)


def test_dynamic_rope_past_max_position_embeddings(tmp_path):
    """Dynamic NTK changes the frequencies once the sequence outgrows max_position_embeddings; fusedkv
    recomputes them from each forward's positions, as transformers' rotary embedding does."""
    case = ("dyn", "LlamaForCausalLM", "LlamaConfig", dict(
        max_position_embeddings=16, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
            None)
    src, reference = build(case, tmp_path)
    ours = convert_checkpoint(src, tmp_path / "out").eval()
    ids, mask = left_padded_batch()  # 19 tokens > 16
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = reference(ids, attention_mask=mask, position_ids=positions).logits
        got = ours(ids, attention_mask=mask, use_cache=False).logits
        assert (got[mask.bool()] - want[mask.bool()]).abs().max() < 1e-5
        a = reference.generate(ids[:1], max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
        b = ours.generate(ids[:1], max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(a, b)


@pytest.mark.parametrize("plan", ["gqa", "fusedkv+gqa"])
def test_gqa_on_a_multi_head_checkpoint_mean_pools_the_kv_heads(plan, tmp_path):
    """`PLAN+gqa` asks for half the query heads as KV heads; a checkpoint with one KV head per query head gets
    each pair of K/V heads mean-pooled (the GQA uptraining initialisation)."""
    case = ("mha", "LlamaForCausalLM", "LlamaConfig", dict(num_key_value_heads=4, attention_bias=True), None)
    src, reference = build(case, tmp_path)
    model = convert_checkpoint(src, tmp_path / "out", kv_sharing=plan).eval()
    assert model.config.num_key_value_heads == 2
    source = reference.model.layers[0].self_attn
    for proj in ("k_proj", "v_proj"):
        want = getattr(source, proj).weight.reshape(2, 2, 16, 64).mean(1).reshape(32, 64)
        assert torch.allclose(getattr(model.model.layers[0].self_attn, proj).weight, want)
        want_bias = getattr(source, proj).bias.reshape(2, 2, 16).mean(1).reshape(32)
        assert torch.allclose(getattr(model.model.layers[0].self_attn, proj).bias, want_bias)
    ids, mask = left_padded_batch()
    assert generate(model, ids, 4, attention_mask=mask).tokens.shape == (2, 23)
    # a checkpoint that already has at most half as many KV heads keeps its own
    case = ("gqa-src", "LlamaForCausalLM", "LlamaConfig", dict(num_key_value_heads=1), None)
    src, _ = build(case, tmp_path)
    assert convert_checkpoint(src, tmp_path / "out2", kv_sharing=plan).config.num_key_value_heads == 1
