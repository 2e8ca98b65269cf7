"""Sparse layers served on vLLM's FusedMoE (the plugin's default MoE path, `fusedkv/serving/vllm_moe.py`) give
the greedy tokens of `fusedkv generate` (and of transformers' own class for vanilla imports) and its prompt
log-probabilities within LOGPROB_TOL, in float32.

Checkpoints (tiny, random, head_dim 32; routers drawn wide enough that top-k choices are not near-ties):
  * Qwen3-MoE built with transformers' `Qwen3MoeForCausalLM` (softmax top-k, norm_topk_prob, a dense layer
    by mlp_only_layers), imported with `fusedkv convert` as vanilla and FusedKV;
  * DeepSeek-V3 built with transformers' `DeepseekV3ForCausalLM` (MLA; sigmoid scores with a non-zero
    e_score_correction_bias, 4 groups of which 2 are kept, routed_scaling_factor 2.5, a shared expert, a
    first dense layer by first_k_dense_replace), imported as vanilla and FusedKV;
  * DeepSeek-V2's routing on Qwen3 attention (softmax, group_limited_greedy, no renormalisation, two shared
    experts, routed_scaling_factor 1.5), FusedKV;
  * a hidden size (80) that vLLM's CPU fused-MoE kernel cannot run (it needs multiples of 32): served on the
    exact path (the model's own SparseMoE as a custom op), FusedKV.

One vLLM process, one eager engine per checkpoint (six in all). Without vLLM: the path variable is checked
before vLLM starts (`plugin.check_servable`, which `fusedkv serve` runs first).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from family_checkpoints import randomize_fusion
from tiny_checkpoints import MAX_NEW_TOKENS, PROMPTS, reference_outputs, tiny_config, write_tokenizer

from tests.serving.conftest import results_of, submit_offline

# fp32, two summation orders of the same math (vLLM's fused CPU kernel against grouped GEMMs); observed ~1e-6.
LOGPROB_TOL = 1e-4

SHAPE = dict(hidden_size=128, intermediate_size=192, moe_intermediate_size=48, num_hidden_layers=4,
             num_attention_heads=4, max_position_embeddings=512, initializer_range=0.08, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=0, eos_token_id=0,
             pad_token_id=1)
V2_ROUTING = dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=False,
                  n_shared_experts=2, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                  routed_scaling_factor=1.5, mlp_only_layers=[0])
ODD_HIDDEN = dict(hidden_size=80, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)

IMPORTED = ["qwen3-moe", "deepseek-v3"]
SERVED = [f"{family}-{plan}" for family in IMPORTED for plan in ("vanilla", "fusedkv")] + ["v2-routing-fusedkv",
                                                                                             "odd-hidden-fusedkv"]
EXACT_PATH = {"odd-hidden-fusedkv"}


def qwen3_moe_hf(vocab: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=vocab, num_experts=8, num_experts_per_tok=2,
                                              norm_topk_prob=True, mlp_only_layers=[1], num_key_value_heads=2,
                                              head_dim=32, **SHAPE))


def deepseek_v3_hf(vocab: int):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=vocab, num_key_value_heads=4, kv_lora_rank=48, q_lora_rank=None, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4,
        topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, **SHAPE))


@torch.no_grad()
def spread_routing(model, seed: int = 2):
    """Router weights wide enough that top-k choices are clear, and a non-zero DeepSeek-V3 score bias."""
    g = torch.Generator().manual_seed(seed)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith("mlp.gate.weight"):
            t.copy_(torch.randn(t.shape, generator=g) * 0.3)
        elif name.endswith("e_score_correction_bias"):
            t.copy_(torch.randn(t.shape, generator=g) * 0.2)
    return model.eval()


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory) -> dict[str, Path]:
    from fusedkv import FusedKVForCausalLM
    from fusedkv.convert import convert_checkpoint

    root = tmp_path_factory.mktemp("fused-moe")
    tok_dir = root / "_tokenizer"
    vocab = len(write_tokenizer(tok_dir))
    paths = {}
    for family, build in (("qwen3-moe", qwen3_moe_hf), ("deepseek-v3", deepseek_v3_hf)):
        torch.manual_seed(0)
        src = root / f"{family}-hf"
        spread_routing(build(vocab)).save_pretrained(src)
        paths[f"{family}-hf"] = src
        for plan in ("vanilla", "fusedkv"):
            convert_checkpoint(src, root / f"{family}-{plan}", kv_sharing=plan)
            paths[f"{family}-{plan}"] = root / f"{family}-{plan}"
    for name, fields in (("v2-routing-fusedkv", V2_ROUTING), ("odd-hidden-fusedkv", ODD_HIDDEN)):
        torch.manual_seed(0)
        spread_routing(FusedKVForCausalLM(tiny_config("fusedkv", vocab, **fields))).save_pretrained(root / name)
        paths[name] = root / name
    for name in SERVED:
        if name.endswith("-fusedkv"):
            randomize_fusion(paths[name])
        for f in tok_dir.iterdir():
            shutil.copy(f, paths[name] / f.name)
    return paths


@pytest.fixture(scope="module")
def references(moe_checkpoints) -> dict[str, dict]:
    return {name: reference_outputs(moe_checkpoints[name]) for name in SERVED}


@pytest.fixture(scope="module")
def served(vllm_workers, moe_checkpoints, tmp_path_factory):
    """The six engines in two halves, one per worker; the references are computed while they run."""
    prompts = [row["prompt_ids"] for row in reference_outputs(moe_checkpoints[SERVED[0]])["rows"]]
    halves = [SERVED[:3], SERVED[3:]]
    return results_of([(names, submit_offline(vllm_workers, [moe_checkpoints[n] for n in names], prompts,
                                              tmp_path_factory.mktemp("vllm"), "--prompt-logprobs"))
                       for names in halves])


@pytest.mark.slow  # starts vLLM
@pytest.mark.parametrize("name", SERVED)
def test_sparse_layers_run_on_the_chosen_path(name, served, moe_checkpoints):
    from fusedkv import FusedKVConfig
    from fusedkv.model.moe import is_sparse_layer

    config = FusedKVConfig.from_pretrained(moe_checkpoints[name])
    sparse = "ServedMoE" if name in EXACT_PATH else "FusedSparseMoE"
    expected = [sparse if is_sparse_layer(config, i) else "GatedMLP" for i in range(config.num_hidden_layers)]
    assert "GatedMLP" in expected or name in EXACT_PATH  # a dense layer among the sparse ones
    assert served[name]["mlp"] == expected


@pytest.mark.slow
@pytest.mark.parametrize("name", SERVED)
def test_greedy_tokens_and_prompt_logprobs_equal_fusedkv(name, served, references):
    ref, got = references[name]["rows"], served[name]["rows"]
    assert len(ref) == len(got) == len(PROMPTS)
    worst = 0.0
    for r, g in zip(ref, got):
        assert g["tokens"] == r["tokens"], f"{name}: greedy tokens differ for prompt {r['prompt']!r}"
        assert len(g["tokens"]) == MAX_NEW_TOKENS
        worst = max(worst, *(abs(a - b) for a, b in zip(g["prompt_logprobs"], r["prompt_logprobs"])))
    print(f"{name}: max |prompt logprob difference| = {worst:.2e}")
    assert worst < LOGPROB_TOL, f"{name}: prompt log-probabilities differ by {worst:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("family", IMPORTED)
@torch.no_grad()
def test_vanilla_import_served_equals_transformers(family, served, moe_checkpoints, references):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_checkpoints[f"{family}-hf"]).eval()
    for ref, row in zip(references[f"{family}-vanilla"]["rows"], served[f"{family}-vanilla"]["rows"]):
        ids = torch.tensor([ref["prompt_ids"]])
        gen = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=1)
        assert row["tokens"] == gen[0, ids.shape[1]:].tolist(), (family, ref["prompt"])


def test_moe_path_variable_is_checked_before_vllm_starts(monkeypatch):
    from fusedkv.serving.plugin import MOE_ENV, check_servable

    moe = tiny_config("vanilla", 64, **ODD_HIDDEN)
    for ok in ("", "fused", "exact"):
        monkeypatch.setenv(MOE_ENV, ok)
        check_servable(moe)
    monkeypatch.setenv(MOE_ENV, "fast")
    with pytest.raises(ValueError, match=f"{MOE_ENV}='fast': choose 'fused'"):
        check_servable(moe)
    check_servable(tiny_config("vanilla", 64))  # a dense model does not read it
