"""Every plan served by vLLM through the plugin gives the transformers model's outputs, and only storage
layers own cache blocks.

vLLM runs every checkpoint (the session's worker processes, in-process engines, eager mode, float32, block size
32, the same KV-cache memory for all): greedy tokens must equal `generate`'s, and the log-probability of every
prompt token must equal a full forward's. A second run splits prefills into 32-token chunks, so the
reconstruction layers' paged reads see queries that start mid-sequence; a third turns on prefill
skipping (vLLM's kv_sharing_fast_prefill).
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from tests.serving.conftest import PLANS, results_of, submit_offline

pytestmark = pytest.mark.slow  # the fast tier (-m 'not slow') leaves this module to the full suite

KV_CACHE_BYTES = 64 << 20
LOGPROB_TOL = 1e-4  # fp32, two implementations of the same math: observed differences are ~3e-6


CHUNKED = ["fusedkv", "fusedkv-lite", "two-k-one-v"]
FAST_PREFILL = ["cla", "yoco", "fusedkv-lite", "fusedkv", "two-k-one-v"]


@pytest.fixture(scope="module")
def runs(vllm_workers, checkpoints, references, tmp_path_factory) -> dict:
    """The module's vLLM runs, started together so that they share the session's workers: every plan (in two
    halves), chunked prefill, prefill skipping. Futures: each test waits for the run it reads."""
    prompts = [row["prompt_ids"] for row in references["vanilla"]["rows"]]
    plans = list(PLANS)

    def run(plans, *extra):
        return submit_offline(vllm_workers, [checkpoints[p] for p in plans], prompts, tmp_path_factory.mktemp("vllm"),
                              *extra)

    halves = [plans[:len(plans) // 2], plans[len(plans) // 2:]]
    return {"served": [(h, run(h, "--prompt-logprobs", "--kv-cache-memory", str(KV_CACHE_BYTES))) for h in halves],
            "chunked": run(CHUNKED, "--prompt-logprobs", "--max-num-batched-tokens", "32", "--max-num-seqs", "4",
                           "--max-new-tokens", "8"),
            "fast_prefill": run(FAST_PREFILL, "--fast-prefill")}


@pytest.fixture(scope="module")
def served(runs) -> Mapping[str, dict]:
    return results_of(runs["served"])


@pytest.mark.parametrize("plan", list(PLANS))
def test_greedy_tokens_and_prompt_logprobs_equal_transformers(plan, served, references):
    ref, got = references[plan]["rows"], served[plan]["rows"]
    assert len(ref) == len(got)
    for r, g in zip(ref, got):
        assert g["tokens"] == r["tokens"], f"{plan}: greedy tokens differ for prompt {r['prompt']!r}"
        assert len(g["prompt_logprobs"]) == len(r["prompt_logprobs"]) == len(r["prompt_ids"]) - 1
        worst = max(abs(a - b) for a, b in zip(g["prompt_logprobs"], r["prompt_logprobs"]))
        assert worst < LOGPROB_TOL, f"{plan}: prompt log-probabilities differ by {worst:.2e}"


def test_only_storage_layers_own_cache_blocks(served, references):
    """Same KV-cache memory: vLLM fits blocks in proportion to 1 / (storage layers x KV heads)."""
    def units(plan):  # cache bytes per token, in (layer x KV head) units
        return len(references[plan]["storage_layers"]) * served[plan]["kv_heads"]

    vanilla = served["vanilla"]
    assert vanilla["num_blocks"] > 0
    for plan, result in served.items():
        expected = vanilla["num_blocks"] * units("vanilla") // units(plan)
        assert result["num_blocks"] == expected, f"{plan}: {result['num_blocks']} blocks, expected {expected}"
    # The half plans (every upper layer rebuilds K/V): twice vanilla's capacity, as vLLM counts it.
    for plan in ("cla", "yoco", "fusedkv-lite", "fusedkv"):
        assert served[plan]["num_blocks"] == 2 * vanilla["num_blocks"]
        assert served[plan]["max_concurrency"] == pytest.approx(2 * vanilla["max_concurrency"])


def test_chunked_prefill_reads_the_right_positions(runs, references):
    plans = CHUNKED
    prompts = [row["prompt_ids"] for row in references["vanilla"]["rows"]]
    assert max(map(len, prompts)) > 32  # at least one prompt spans several chunks and cache blocks
    results = runs["chunked"].result()  # --max-num-batched-tokens 32 --max-num-seqs 4 --max-new-tokens 8
    for plan, result in zip(plans, results, strict=True):
        for r, g in zip(references[plan]["rows"], result["rows"]):
            assert g["tokens"] == r["tokens"][:8], plan
            assert max(abs(a - b) for a, b in zip(g["prompt_logprobs"], r["prompt_logprobs"])) < LOGPROB_TOL, plan


def test_prefill_skipping_keeps_greedy_tokens(runs, references):
    """vLLM's --kv-sharing-fast-prefill: the layers after the last storage layer run only on the sampled
    positions (paper Sec. 3.3); what is generated must not change."""
    plans = FAST_PREFILL
    results = runs["fast_prefill"].result()
    for plan, result in zip(plans, results, strict=True):
        assert [g["tokens"] for g in result["rows"]] == [r["tokens"] for r in references[plan]["rows"]], plan
