"""Triton decode kernel (and the model's decode through it) under the CPU interpreter; the kernel part
of the GPU benchmark in a dry run; the CPU attention-path benchmark in a quick run.

Both run in subprocesses with ``TRITON_INTERPRET=1`` in their environment from the start: the
interpreter has to be on before Triton is first imported, and this (main) pytest process has
already imported Triton without it (``import fusedkv`` -> transformers -> torch._dynamo -> triton).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO),
           "TRITON_DEFAULT_FP_FUSION": os.environ.get("TRITON_DEFAULT_FP_FUSION", "1")}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_triton_kernel_under_interpreter():
    r = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.kernels._triton_interpreter",
              "-o", "addopts=", str(HERE / "_triton_interpret_cases.py")], timeout=300)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]


@pytest.mark.slow
def test_gpu_benchmark_kernel_part_dry_run():
    # `python -m fusedkv.speed.gpu_suite ARGS`, with the interpreter's repeated set-up skipped (_triton_interpreter.py)
    run = ("import runpy, tests.kernels._triton_interpreter; "
           "runpy.run_module('fusedkv.speed.gpu_suite', run_name='__main__', alter_sys=True)")
    r = _run([sys.executable, "-c", run, "--dry-run", "--skip-model", "--tune"], timeout=300)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    out = r.stdout
    assert "### Decode throughput" in out and "### Launch sweep" in out and "0 failed checks" in out
    assert "**WRONG**" not in out and "ours FusedKV" in out and "sdpa" in out


@pytest.mark.slow
def test_cpu_attention_paths_benchmark_quick():
    r = _run([sys.executable, str(REPO / "benchmarks" / "attention_paths_cpu.py"), "--quick"], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "speed-up" in r.stdout
