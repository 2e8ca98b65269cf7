"""Checkpoints imported from Llama, Mistral, Qwen2, Gemma 3 and Gemma 2 (`fusedkv convert`) are served by the
vLLM plugin with the reference's tokens, as vanilla and under half-cache plans (tests/serving/family_checkpoints.py
lists the features each one switches on).

vLLM runs every checkpoint (the session's worker processes, in-process engines, eager, float32, block size
32): greedy tokens must equal transformers' `generate` (vanilla) or fusedkv's (plans), prompt log-probabilities
fusedkv's full forward, and the half plans get twice vanilla's cache blocks. A second run splits prefills into
32-token chunks over the window plans, so the window layers' paged reads start mid-sequence.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from family_checkpoints import FAMILIES, MAX_NEW_TOKENS, prompts, references, write_family_checkpoints

from tests.serving.conftest import results_of, submit_offline

pytestmark = pytest.mark.slow  # starts vLLM

LOGPROB_TOL = 1e-4  # fp32, two implementations of the same math: observed differences are ~5e-6
CASES = [f"{family}/{plan}" for family, (*_, plans) in FAMILIES.items() for plan in ["vanilla", *plans]]


@pytest.fixture(scope="module")
def family_sources(vllm_python, tmp_path_factory):
    """({"family/plan": checkpoint directory}, {family: transformers model})."""
    return write_family_checkpoints(tmp_path_factory.mktemp("families"))


@pytest.fixture(scope="module")
def family_checkpoints(family_sources, runs):
    """({"family/plan": directory}, {"family/plan": reference}); the references are computed while vLLM runs."""
    paths, sources = family_sources
    return paths, references(paths, sources)


WINDOW_CASES = ["mistral/fusedkv", "gemma2/fusedkv-lite", "gemma3/fusedkv"]


@pytest.fixture(scope="module")
def runs(vllm_workers, family_sources, tmp_path_factory) -> dict:
    """The module's vLLM runs, started together so that they share the session's workers: every case (in two
    halves), and chunked prefill over the window plans. Futures: each test waits for the run it reads."""
    paths, _ = family_sources

    def run(cases, *extra):
        return submit_offline(vllm_workers, [paths[c] for c in cases], prompts(), tmp_path_factory.mktemp("vllm"),
                              *extra, "--max-model-len", "256")

    halves = [CASES[:len(CASES) // 2], CASES[len(CASES) // 2:]]
    return {"served": [(h, run(h, "--prompt-logprobs", "--max-new-tokens", str(MAX_NEW_TOKENS))) for h in halves],
            "chunked": run(WINDOW_CASES, "--prompt-logprobs", "--max-num-batched-tokens", "32", "--max-num-seqs", "2",
                           "--max-new-tokens", "8")}


@pytest.fixture(scope="module")
def served(runs) -> Mapping[str, dict]:
    return results_of(runs["served"])


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


def test_window_layers_read_the_right_positions_in_chunked_prefill(runs, family_checkpoints):
    _, refs = family_checkpoints
    cases = WINDOW_CASES
    results = runs["chunked"].result()  # --max-num-batched-tokens 32 --max-num-seqs 2 --max-new-tokens 8
    for case, result in zip(cases, results, strict=True):
        for r, g in zip(refs[case]["rows"], result["rows"]):
            assert g["tokens"] == r["tokens"][:8], case
            assert max(abs(a - b) for a, b in zip(g["prompt_logprobs"], r["prompt_logprobs"])) < LOGPROB_TOL, case
