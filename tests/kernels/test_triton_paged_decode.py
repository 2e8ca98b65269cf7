"""The paged Triton decode kernel over vLLM-layout block tables, and a mixed vLLM batch through it,
against a float64 reference (plain causal, sliding windows, soft caps): on CPU under the Triton interpreter
(a subprocess with TRITON_INTERPRET=1 from the start, see `_triton_paged_interpret_cases.py`), and compiled
on CUDA when a GPU is present."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.mark.slow
def test_paged_kernel_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{HERE}",
           "TRITON_DEFAULT_FP_FUSION": os.environ.get("TRITON_DEFAULT_FP_FUSION", "1")}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                        "tests.kernels._triton_interpreter", "-o", "addopts=",
                        str(HERE / "_triton_paged_interpret_cases.py")], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]


# ---- compiled on a GPU: the same checks, plus lengths that need many splits ------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-2)])
@pytest.mark.parametrize("g", [1, 2, 8])
@pytest.mark.parametrize("sources", ["fusedkv", "lite", "mixed"])
def test_paged_kernel_on_cuda(sources, g, dtype, tol):
    sys.path.insert(0, str(HERE))
    from _paged_decode_checks import check_kernel

    n_k, n_v, weighted = {"fusedkv": (2, 2, True), "lite": (1, 1, False), "mixed": (2, 1, True)}[sources]
    for num_splits in (None, 1, 4):
        check_kernel([1, 16, 37, 50, 700], 2, g, n_k, n_v, weighted, "cuda", dtype=dtype, num_splits=num_splits,
                     tol=tol, d=64)


@cuda
@pytest.mark.parametrize("use_kernel", [True, False])
def test_mixed_batch_on_cuda(use_kernel):
    sys.path.insert(0, str(HERE))
    from _paged_decode_checks import check_batch

    check_batch([37, 37, 1, 20, 16], [1, 5, 1, 20, 1], 2, 2, 2, 2, True, "cuda", use_kernel=use_kernel)
    check_batch([1, 16, 300], [1, 1, 1], 2, 4, 1, 1, False, "cuda", use_kernel=use_kernel)


@cuda
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("g", [1, 8])
@pytest.mark.parametrize("window, softcap", [(1, None), (64, None), (700, 2.5), (None, 2.5), (100, 2.5)])
def test_paged_kernel_window_and_softcap_on_cuda(window, softcap, g, dtype, tol):
    sys.path.insert(0, str(HERE))
    from _paged_decode_checks import check_batch, check_kernel

    for num_splits in (None, 1, 4):
        check_kernel([1, 16, 37, 50, 64, 65, 700], 2, g, 2, 2, True, "cuda", dtype=dtype, num_splits=num_splits,
                     tol=tol, d=64, scale=0.5, window=window, softcap=softcap)
    if dtype == torch.float32:
        for use_kernel in (True, False):
            check_batch([50, 37, 3, 20, 16, 300], [20, 1, 1, 20, 1, 5], 2, g, 2, 2, True, "cuda",
                        use_kernel=use_kernel, scale=0.5, window=window, softcap=softcap)
