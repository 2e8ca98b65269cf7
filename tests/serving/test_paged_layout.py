"""The paged-cache gather of FusedKV reconstruction layers reads what vLLM's CPU backend wrote
(`_paged_layout_cases.py`, run with the vLLM environment's Python)."""

import subprocess
from pathlib import Path

import pytest

from tests.serving.conftest import REPO, vllm_env


@pytest.mark.slow  # vLLM's own cache writes, in the vLLM environment: the full suite's
def test_gathered_blocks_equal_the_tokens_vllm_wrote(vllm_python):
    case = Path(__file__).with_name("_paged_layout_cases.py")
    r = subprocess.run([vllm_python, str(case)], cwd=REPO, env=vllm_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "ALL OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
