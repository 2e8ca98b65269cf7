"""Checkpoints imported from Llama, Mistral, Qwen2, Gemma 3 and Gemma 2 (`fusedkv convert`) are served by the
vLLM plugin with the reference's tokens, as vanilla and under half-cache plans (tests/serving/family_checkpoints.py
lists the features each one switches on).

One vLLM process runs every checkpoint (in-process engine, eager, float32, block size 32): greedy tokens must
equal transformers' `generate` (vanilla) or fusedkv's (plans), prompt log-probabilities fusedkv's full forward,
and the half plans get twice vanilla's cache blocks. A second run splits prefills into 32-token chunks over the
window plans, so the window layers' paged reads start mid-sequence.
"""

from __future__ import annotations

import pytest
from family_checkpoints import FAMILIES, MAX_NEW_TOKENS, prompts, write_family_checkpoints

from tests.serving.conftest import run_offline

pytestmark = pytest.mark.slow  # starts vLLM

LOGPROB_TOL = 1e-4  # fp32, two implementations of the same math: observed differences are ~5e-6
CASES = [f"{family}/{plan}" for family, (*_, plans) in FAMILIES.items() for plan in ["vanilla", *plans]]


@pytest.fixture(scope="module")
def family_checkpoints(vllm_python, tmp_path_factory):
    return write_family_checkpoints(tmp_path_factory.mktemp("families"))


@pytest.fixture(scope="module")
def served(vllm_worker, family_checkpoints, tmp_path_factory):
    paths, _ = family_checkpoints
    results = run_offline(vllm_worker, [paths[c] for c in CASES], prompts(), tmp_path_factory.mktemp("vllm"),
                          "--prompt-logprobs", "--max-new-tokens", str(MAX_NEW_TOKENS), "--max-model-len", "256")
    return dict(zip(CASES, results))


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_and_prompt_logprobs_equal_the_reference(case, served, family_checkpoints):
    _, refs = family_checkpoints
    ref, got = refs[case]["rows"], served[case]["rows"]
    assert len(ref) == len(got) == len(prompts())
    for i, (r, g) in enumerate(zip(ref, got)):
        assert g["tokens"] == r["tokens"], f"{case}: greedy tokens differ for prompt {i}"
        worst = max(abs(a - b) for a, b in zip(g["prompt_logprobs"], r["prompt_logprobs"]))
        assert worst < LOGPROB_TOL, f"{case}: prompt log-probabilities differ by {worst:.2e}"


def test_half_cache_plans_get_twice_the_blocks(served):
    for family, (*_, plans) in FAMILIES.items():
        vanilla = served[f"{family}/vanilla"]["num_blocks"]
        for plan in plans:
            assert served[f"{family}/{plan}"]["num_blocks"] == 2 * vanilla, f"{family}/{plan}"


def test_window_layers_read_the_right_positions_in_chunked_prefill(vllm_worker, family_checkpoints, tmp_path):
    paths, refs = family_checkpoints
    cases = ["mistral/fusedkv", "gemma2/fusedkv-lite", "gemma3/fusedkv"]
    results = run_offline(vllm_worker, [paths[c] for c in cases], prompts(), tmp_path, "--prompt-logprobs",
                          "--max-num-batched-tokens", "32", "--max-num-seqs", "2", "--max-new-tokens", "8",
                          "--max-model-len", "256")
    for case, result in zip(cases, results):
        for r, g in zip(refs[case]["rows"], result["rows"]):
            assert g["tokens"] == r["tokens"][:8], case
            assert max(abs(a - b) for a, b in zip(g["prompt_logprobs"], r["prompt_logprobs"])) < LOGPROB_TOL, case
