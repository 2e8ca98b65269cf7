"""Fixtures of the serving tests: the vLLM environment, tiny checkpoints of every plan and what the
transformers model says about them.

vLLM lives in its own environment (`scripts/install-vllm.sh`), so these tests run vLLM in a
subprocess with that environment's Python and compare through JSON files. Without it they are
skipped, saying how to install it; with FUSEDKV_REQUIRE_VLLM=1 (CI) a missing install fails instead.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from tiny_checkpoints import PLANS, reference_outputs, write_checkpoints

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def vllm_python() -> str:
    from fusedkv.errors import UsageError
    from fusedkv.serving.command import check_vllm_environment, find_vllm_python

    try:
        python = find_vllm_python()
        check_vllm_environment(python)
    except UsageError as e:
        if os.environ.get("FUSEDKV_REQUIRE_VLLM", "") not in ("", "0"):
            pytest.fail(f"FUSEDKV_REQUIRE_VLLM is set but the vLLM environment is unusable: {e}")
        pytest.skip(f"the vLLM environment is not installed ({e}); CI installs it with scripts/install-vllm.sh")
    return python


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    return write_checkpoints(tmp_path_factory.mktemp("serving-ckpts"))


@pytest.fixture(scope="session")
def references(checkpoints) -> dict[str, dict]:
    return {plan: reference_outputs(path) for plan, path in checkpoints.items()}


def vllm_env() -> dict:
    # One thread per engine: the machine is small and shared, and vLLM's OpenMP threads spin.
    return {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}


def run_offline(vllm_python: str, models: list[Path], prompts: list[list[int]], out_dir: Path, *extra: str,
                timeout: int = 1200) -> list[dict]:
    """`fusedkv.serving.offline` in the vLLM environment; returns its per-checkpoint results."""
    prompts_file, out_file = out_dir / "prompts.json", out_dir / "vllm.json"
    prompts_file.write_text(json.dumps(prompts))
    cmd = [vllm_python, "-m", "fusedkv.serving.offline", "--models", *map(str, models), "--prompts", str(prompts_file),
           "--out", str(out_file), *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=vllm_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"vLLM run failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out_file.read_text())


__all__ = ["PLANS", "REPO", "run_offline", "vllm_env"]
