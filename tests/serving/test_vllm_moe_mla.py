"""Mixture-of-experts and latent-attention (MLA) FusedKV checkpoints served by vLLM through the plugin give
the same greedy tokens and prompt log-probabilities as `fusedkv generate`'s model, and for vanilla imports
the same greedy tokens as transformers' own class, in float32.

Checkpoints (tiny, random; head_dim 32 where vLLM's CPU attention runs the layer):
  * Qwen3-MoE built with transformers' `Qwen3MoeForCausalLM` (a dense layer among sparse ones);
  * DeepSeek-V3 built with transformers' `DeepseekV3ForCausalLM`: MLA and DeepSeekMoE (sigmoid scores, a
    non-zero `e_score_correction_bias`, grouped top-k, routed_scaling_factor, a shared expert, a first dense
    layer), with the low-rank query (plus interleaved RoPE and YaRN with mscale) and without it;
  each imported with `fusedkv convert`, vanilla and FusedKV (random fusion weights: fused latents);
  * DeepSeekMoE routing on Qwen3 attention, built as a fusedkv config, vanilla and FusedKV.

vLLM runs every checkpoint (the session's worker processes, one engine each, eager, float32); another run takes
the MLA + MoE FusedKV checkpoint through torch.compile with prefills split into 32-token chunks.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from tiny_checkpoints import MAX_NEW_TOKENS, PROMPTS, reference_outputs, tiny_config, write_tokenizer

from tests import _cli as cli_process
from tests.serving.conftest import REPO, results_of, submit_offline, vllm_env

pytestmark = pytest.mark.slow  # starts vLLM

LOGPROB_TOL = 1e-4  # fp32, two implementations of the same math (observed: ~1e-6)

DEEPSEEK_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                    n_shared_experts=1, topk_method="noaux_tc", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                    mlp_only_layers=[0])


def convert(src: Path, dst: Path, *args: str) -> None:
    r = cli_process.fusedkv("convert", str(src), str(dst), *args, cwd=REPO, env=vllm_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


@torch.no_grad()
def randomise_fusion(path: Path, seed: int = 1) -> None:
    from fusedkv import FusedKVForCausalLM

    model = FusedKVForCausalLM.from_pretrained(path).eval()
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "fusion" in name:
            p.copy_(torch.randn(p.shape, generator=g) * 0.7 + 0.3)
    model.save_pretrained(path)


@torch.no_grad()
def widen_router(model, seed: int = 2) -> None:
    """Router weights wide enough that top-k choices are not near-ties, and a non-zero V3 score bias."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(torch.randn(b.shape, generator=g) * 0.2)


def qwen3_moe_hf(vocab: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=128, intermediate_size=192, moe_intermediate_size=48,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=512, initializer_range=0.08, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=0,
                         eos_token_id=0, pad_token_id=1)
    return Qwen3MoeForCausalLM(cfg)


def deepseek_v3_hf(vocab: int, q_lora_rank: int | None):
    """DeepSeek-V3 with MLA (a 48-channel latent and 16 RoPE channels: one 64-wide cache row per token) and
    DeepSeekMoE; with the low-rank query also DeepSeek's interleaved RoPE and YaRN with mscale_all_dim."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    rope = ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707} if q_lora_rank else
            {"rope_type": "default", "rope_theta": 10000.0})
    cfg = DeepseekV3Config(vocab_size=vocab, hidden_size=128, intermediate_size=192, moe_intermediate_size=48,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=48,
                           q_lora_rank=q_lora_rank, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                           n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
                           first_k_dense_replace=1, routed_scaling_factor=2.5, rope_interleave=bool(q_lora_rank),
                           max_position_embeddings=512, initializer_range=0.08, tie_word_embeddings=False,
                           rope_parameters=rope, bos_token_id=0, eos_token_id=0, pad_token_id=1)
    return DeepseekV3ForCausalLM(cfg)


def finish(path: Path, tok_dir: Path, plan: str) -> None:
    """The tokenizer beside the weights; fusion weights away from their tidy initial values."""
    for f in tok_dir.iterdir():
        shutil.copy(f, path / f.name)
    if plan != "vanilla":
        randomise_fusion(path)


def imported(root: Path, tok_dir: Path, name: str, model) -> dict[str, Path]:
    """`model` (transformers' class) saved, then `fusedkv convert`ed to vanilla and FusedKV checkpoints."""
    widen_router(model.eval())
    src = root / f"{name}-hf"
    model.save_pretrained(src)
    out = {f"{name}-hf": src}
    for plan in ("vanilla", "fusedkv"):
        dst = root / f"{name}-{plan}"
        convert(src, dst, "--plan", plan)
        finish(dst, tok_dir, plan)
        out[f"{name}-{plan}"] = dst
    return out


def deepseek_moe(root: Path, tok_dir: Path, vocab: int) -> dict[str, Path]:
    from fusedkv import FusedKVForCausalLM

    out = {}
    for plan in ("vanilla", "fusedkv"):
        torch.manual_seed(0)
        model = FusedKVForCausalLM(tiny_config(plan, vocab, **DEEPSEEK_MOE)).eval()
        widen_router(model)
        path = root / f"deepseek-moe-{plan}"
        model.save_pretrained(path)
        finish(path, tok_dir, plan)
        out[f"deepseek-moe-{plan}"] = path
    return out


FAMILIES = ["qwen3-moe", "deepseek-moe", "deepseek-v3-qlora", "deepseek-v3-fullq"]
SERVED = [f"{family}-{plan}" for family in FAMILIES for plan in ("vanilla", "fusedkv")]
FROM_TRANSFORMERS = ["qwen3-moe", "deepseek-v3-qlora", "deepseek-v3-fullq"]
COMPILED = "deepseek-v3-qlora-fusedkv"


def submit_run(workers, paths: dict[str, Path], names: list[str], out_dir: Path, *extra: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(paths[names[0]])
    prompts = [tok(prompt).input_ids for prompt in PROMPTS]  # as reference_outputs tokenises them
    return submit_offline(workers, [paths[n] for n in names], prompts, out_dir, *extra)


@pytest.fixture(scope="module")
def moe_build(vllm_workers, tmp_path_factory) -> tuple[dict[str, Path], Future]:
    """The checkpoints, and the torch.compile run with chunked prefill (the module's longest) started as soon as
    its checkpoint is written, so that it runs while the others are built: (paths, its future)."""
    root = tmp_path_factory.mktemp("moe-mla")
    tok_dir = root / "_tokenizer"
    vocab = len(write_tokenizer(tok_dir))
    out, compiled = {}, None
    for name, build in (("deepseek-v3-qlora", lambda: deepseek_v3_hf(vocab, 32)),
                        ("qwen3-moe", lambda: qwen3_moe_hf(vocab)),
                        ("deepseek-v3-fullq", lambda: deepseek_v3_hf(vocab, None))):
        torch.manual_seed(0)
        out.update(imported(root, tok_dir, name, build()))
        if compiled is None:
            compiled = submit_run(vllm_workers, out, [COMPILED], tmp_path_factory.mktemp("vllm"), "--compile",
                                  "--prompt-logprobs", "--max-num-batched-tokens", "32", "--max-num-seqs", "4")
    out.update(deepseek_moe(root, tok_dir, vocab))
    return out, compiled


@pytest.fixture(scope="module")
def moe_checkpoints(moe_build) -> dict[str, Path]:
    return moe_build[0]


@pytest.fixture(scope="module")
def moe_references(moe_checkpoints) -> dict[str, dict]:
    return {name: reference_outputs(moe_checkpoints[name]) for name in SERVED}


@pytest.fixture(scope="module")
def moe_runs(vllm_workers, moe_build, tmp_path_factory) -> dict:
    """The module's vLLM runs, sharing the session's workers: torch.compile with chunked prefill (started while
    the checkpoints were built), and every checkpoint eager (in two halves). Futures: the references are
    computed while they run."""
    paths, compiled = moe_build
    halves = [SERVED[:len(SERVED) // 2], SERVED[len(SERVED) // 2:]]
    return {"served": [(h, submit_run(vllm_workers, paths, h, tmp_path_factory.mktemp("vllm"), "--prompt-logprobs"))
                       for h in halves], "compiled": compiled}


@pytest.fixture(scope="module")
def moe_served(moe_runs) -> Mapping[str, dict]:
    return results_of(moe_runs["served"])


def same_outputs(name: str, ref: list[dict], got: list[dict], logprobs: bool = True) -> None:
    assert len(ref) == len(got) == len(PROMPTS)
    for r, g in zip(ref, got):
        assert g["tokens"] == r["tokens"], f"{name}: greedy tokens differ for prompt {r['prompt']!r}"
        if logprobs:
            worst = max(abs(a - b) for a, b in zip(g["prompt_logprobs"], r["prompt_logprobs"]))
            assert worst < LOGPROB_TOL, f"{name}: prompt log-probabilities differ by {worst:.2e}"


@pytest.mark.parametrize("name", SERVED)
def test_greedy_tokens_and_prompt_logprobs_equal_fusedkv_generate(name, moe_served, moe_references):
    same_outputs(name, moe_references[name]["rows"], moe_served[name]["rows"])
    assert all(len(g["tokens"]) == MAX_NEW_TOKENS for g in moe_served[name]["rows"])


@pytest.mark.parametrize("family", FAMILIES)
def test_fusedkv_holds_twice_the_blocks(family, moe_served):
    """Same KV-cache memory: the FusedKV model's upper layers own no blocks (MLA: no latent rows)."""
    vanilla, fused = moe_served[f"{family}-vanilla"], moe_served[f"{family}-fusedkv"]
    assert vanilla["num_blocks"] > 0 and fused["num_blocks"] == 2 * vanilla["num_blocks"]


def test_compiled_and_chunked_prefill(moe_runs, moe_references):
    """torch.compile around the MoE and MLA custom ops, and prefill chunks whose queries start mid-sequence."""
    name = COMPILED
    prompts = [row["prompt_ids"] for row in moe_references[name]["rows"]]
    assert max(map(len, prompts)) > 32  # at least one prompt spans several chunks and cache blocks
    [result] = moe_runs["compiled"].result()  # --compile --max-num-batched-tokens 32 --max-num-seqs 4
    same_outputs(name, moe_references[name]["rows"], result["rows"])


@pytest.mark.parametrize("family", FROM_TRANSFORMERS)
@torch.no_grad()
def test_vanilla_import_served_equals_transformers(family, moe_checkpoints, moe_served):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(moe_checkpoints[f"{family}-hf"]).eval()
    tok = AutoTokenizer.from_pretrained(moe_checkpoints[f"{family}-vanilla"])
    rows = moe_served[f"{family}-vanilla"]["rows"]
    assert len(rows) == len(PROMPTS)
    for prompt, row in zip(PROMPTS, rows):
        ids = tok(prompt, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=tok.pad_token_id)
        assert row["tokens"] == gen[0, ids.shape[1]:].tolist(), (family, prompt)
