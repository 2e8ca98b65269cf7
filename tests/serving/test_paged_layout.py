"""The paged-cache gather of FusedKV reconstruction layers reads what vLLM's CPU backend wrote
(`_paged_layout_cases.py`, run by the session's vLLM worker: the vLLM environment's Python)."""

from pathlib import Path

import pytest


@pytest.mark.slow  # vLLM's own cache writes, in the vLLM environment: the full suite's
def test_gathered_blocks_equal_the_tokens_vllm_wrote(vllm_workers):
    r = vllm_workers.run(script=str(Path(__file__).with_name("_paged_layout_cases.py")), timeout=300)
    assert r["rc"] == 0 and "ALL OK" in r["stdout"], r["stdout"][-2000:] + r["log"][-2000:] + r["error"][-2000:]
