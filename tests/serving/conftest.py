"""Fixtures of the serving tests: the vLLM environment, tiny checkpoints of every plan and what the
transformers model says about them.

vLLM lives in its own environment (`scripts/install-vllm.sh`), so these tests run vLLM in a
subprocess with that environment's Python and compare through JSON files. Without it they are
skipped, saying how to install it; with FUSEDKV_REQUIRE_VLLM=1 (CI) a missing install fails instead.
"""

from __future__ import annotations

import json
import os
import select
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
    # One thread per engine: the machine is small and shared, and vLLM's OpenMP threads spin. PYTHONPATH: the
    # vLLM environment's fusedkv is an editable install of some checkout; its processes must import this one.
    return {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


class VLLMWorker:
    """One process of the vLLM environment for the session (`_vllm_worker.py`): it imports vLLM once and runs
    the offline jobs and vLLM-side scripts of every serving test, one after another. A job that kills it
    fails alone: the next job starts a new one."""

    def __init__(self, python: str, log: Path):
        self.python, self.log, self.proc = python, log, None

    def _start(self):
        self.log_file = open(self.log, "a")
        self.proc = subprocess.Popen([self.python, str(Path(__file__).with_name("_vllm_worker.py"))], cwd=REPO,
                                     env=vllm_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log_file, text=True)
        self._answer(600)

    def _answer(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise AssertionError(f"the vLLM worker {'timed out' if not ready else 'died'}:\n{self.log_tail(0)}")
        return json.loads(line)

    def log_tail(self, start: int) -> str:
        return self.log.read_text(errors="replace")[start:][-6000:]

    def run(self, timeout: float = 1200, **job) -> dict:
        """`job`: module= and argv=, or script=; returns {"rc", "stdout", "error", "log"} (log: its stderr)."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        start = self.log.stat().st_size
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        answer = self._answer(timeout)
        return {**answer, "log": self.log_tail(start)}

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@pytest.fixture(scope="session")
def vllm_worker(vllm_python, tmp_path_factory):
    worker = VLLMWorker(vllm_python, tmp_path_factory.mktemp("vllm-worker") / "worker.log")
    yield worker
    worker.close()


def run_offline(worker: VLLMWorker, models: list[Path], prompts: list[list[int]], out_dir: Path, *extra: str,
                timeout: int = 1200) -> list[dict]:
    """`fusedkv.serving.offline` in the vLLM environment (the session's worker); its per-checkpoint results."""
    prompts_file, out_file = out_dir / "prompts.json", out_dir / "vllm.json"
    prompts_file.write_text(json.dumps(prompts))
    argv = ["--models", *map(str, models), "--prompts", str(prompts_file), "--out", str(out_file), *extra]
    r = worker.run(module="fusedkv.serving.offline", argv=argv, timeout=timeout)
    if r["rc"] != 0:
        raise AssertionError(f"vLLM run failed ({r['rc']}):\n{r['log']}\n{r['error']}")
    return json.loads(out_file.read_text())


__all__ = ["PLANS", "REPO", "VLLMWorker", "run_offline", "vllm_env"]
