"""FusedKV reconstruction layers on vLLM's FlashAttention / Triton backends take the paged Triton kernel
path and equal the reference (`_gpu_backend_cases.py`, run with the vLLM environment's Python under the
Triton interpreter: no GPU needed)."""

import importlib.util
import subprocess
from pathlib import Path

import pytest

from tests.serving.conftest import REPO, vllm_env

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.mark.slow
def test_gpu_backend_layers_equal_the_reference(vllm_python):
    case = Path(__file__).with_name("_gpu_backend_cases.py")
    r = subprocess.run([vllm_python, str(case)], cwd=REPO, env={**vllm_env(), "TRITON_INTERPRET": "1"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ALL OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
