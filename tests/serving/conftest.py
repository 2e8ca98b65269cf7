"""Fixtures of the serving tests: the vLLM environment, tiny checkpoints of every plan and what the
transformers model says about them.

vLLM lives in its own environment (`scripts/install-vllm.sh`), so these tests run vLLM in a
subprocess with that environment's Python and compare through JSON files. Without it they are
skipped, saying how to install it; with FUSEDKV_REQUIRE_VLLM=1 (CI) a missing install fails instead.

Where the time goes: every vLLM process pays its imports and, on its first prompt log-probabilities, a
compilation of vLLM's sampler; every engine pays its start-up. So the offline runs go to at most two worker
processes for the whole session (`vllm_workers`, `_vllm_worker.py`) that pay the imports once, in the
background from the first serving test on (`warm_vllm_workers`: a core is idle until the first job), a module
submits its runs together so that both workers (both cores) are busy, and fixtures compute what the tests
compare against while vLLM runs. Checkpoints are made when first read.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
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


class OnDemand(Mapping):
    """A mapping whose values are made when first read: a run of a few tests builds only what they read."""

    def __init__(self, keys, make):
        self.keys_, self.make, self.made = list(keys), make, {}

    def __getitem__(self, key):
        if key not in self.keys_:
            raise KeyError(key)
        if key not in self.made:
            self.made[key] = self.make(key)
        return self.made[key]

    def __iter__(self):
        return iter(self.keys_)

    def __len__(self):
        return len(self.keys_)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> Mapping[str, Path]:
    """{plan: tiny checkpoint directory} for every plan of PLANS, one tokenizer for all."""
    root = tmp_path_factory.mktemp("serving-ckpts")
    return OnDemand(PLANS, lambda plan: write_checkpoints(root, plans=(plan,))[plan])


@pytest.fixture(scope="session")
def references(checkpoints) -> Mapping[str, dict]:
    return OnDemand(PLANS, lambda plan: reference_outputs(checkpoints[plan]))


def vllm_env() -> dict:
    # One thread per engine: the machine is small and shared, and vLLM's OpenMP threads spin. PYTHONPATH: the
    # vLLM environment's fusedkv is an editable install of some checkout; its processes must import this one.
    return {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


class VLLMWorker:
    """One process of the vLLM environment (`_vllm_worker.py`) that lives for the session: it imports vLLM
    once and runs offline jobs and vLLM-side scripts of the serving tests, one after another. A job that kills
    it fails alone: the next job starts a new one."""

    def __init__(self, python: str, log: Path):
        self.python, self.log, self.proc = python, log, None

    def _start(self):
        self.log_file = open(self.log, "a")
        self.proc = subprocess.Popen([self.python, str(Path(__file__).with_name("_vllm_worker.py"))], cwd=REPO,
                                     env=vllm_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log_file, text=True)
        self._answer(600)

    def start_if_needed(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self._start()

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
        self.start_if_needed()
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


class VLLMWorkers:
    """The session's vLLM workers: at most `size` processes, started by `warm` (or when a job first needs one). Jobs
    submitted together run on as many workers at once (on two cores, two), so a module's vLLM runs overlap;
    a job submitted alone runs on a worker already started."""

    def __init__(self, python: str, log_dir: Path, size: int = 2):
        self.python, self.log_dir, self.size = python, log_dir, size
        self.started: list[VLLMWorker] = []
        self.local = threading.local()  # one worker per thread of the pool
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(size, thread_name_prefix="vllm-worker")

    def _worker(self) -> VLLMWorker:
        if getattr(self.local, "worker", None) is None:
            with self.lock:
                self.local.worker = VLLMWorker(self.python, self.log_dir / f"worker{len(self.started)}.log")
                self.started.append(self.local.worker)
        return self.local.worker

    def submit(self, fn, *args) -> Future:
        """`fn(worker, *args)` on a worker, when one is free."""
        return self.pool.submit(lambda: fn(self._worker(), *args))

    def run(self, timeout: float = 1200, **job) -> dict:
        """VLLMWorker.run on a free worker, waited for."""
        return self.submit(lambda w: w.run(timeout, **job)).result()

    def warm(self) -> None:
        """Start every worker now, in the background (their vLLM imports overlap with the tests before the first
        job; one job per pool thread, each holding its thread until its worker is up)."""
        up = threading.Barrier(self.size)

        def start(worker: VLLMWorker) -> None:
            try:
                worker.start_if_needed()  # a failure is the first job's to report: it starts the worker again
            finally:
                with contextlib.suppress(threading.BrokenBarrierError):
                    up.wait(timeout=900)

        for _ in range(self.size):
            self.submit(start)

    def close(self):
        self.pool.shutdown(wait=True, cancel_futures=True)
        for worker in self.started:
            worker.close()


@pytest.fixture(scope="session")
def vllm_workers(vllm_python, tmp_path_factory):
    workers = VLLMWorkers(vllm_python, tmp_path_factory.mktemp("vllm-workers"), size=min(2, os.cpu_count() or 1))
    yield workers
    workers.close()


@pytest.fixture(scope="session", autouse=True)
def warm_vllm_workers(request):
    """When the session will use the workers, start them at its first serving test, in the background: their
    imports overlap with the serving tests that run before the first vLLM job (and leave a core idle)."""
    if not any("vllm_workers" in item.fixturenames for item in request.session.items):
        return
    try:
        workers = request.getfixturevalue("vllm_workers")
    except (pytest.skip.Exception, pytest.fail.Exception):
        return  # no vLLM environment: the tests that need it say so themselves
    workers.warm()


def _offline(worker: VLLMWorker, models: list[Path], prompts: list[list[int]], out_dir: Path, extra: tuple,
             timeout: int) -> list[dict]:
    prompts_file, out_file = out_dir / "prompts.json", out_dir / "vllm.json"
    prompts_file.write_text(json.dumps(prompts))
    argv = ["--models", *map(str, models), "--prompts", str(prompts_file), "--out", str(out_file), *extra]
    r = worker.run(timeout, module="fusedkv.serving.offline", argv=argv)
    if r["rc"] != 0:
        raise AssertionError(f"vLLM run failed ({r['rc']}):\n{r['log']}\n{r['error']}")
    return json.loads(out_file.read_text())


def submit_offline(workers: VLLMWorkers, models: list[Path], prompts: list[list[int]], out_dir: Path, *extra: str,
                   timeout: int = 1200) -> Future:
    """`fusedkv.serving.offline` in the vLLM environment (a session's worker), started now; the future's result
    is its per-checkpoint results. `out_dir`: one per run."""
    return workers.submit(_offline, models, prompts, out_dir, extra, timeout)


def results_of(runs: list[tuple[list[str], Future]]) -> OnDemand:
    """{name: result} over offline runs submitted together ((names, future) pairs), each run waited for when a
    result of it is first read (what a test computes before reading overlaps with the runs)."""
    where = {name: (i, future) for names, future in runs for i, name in enumerate(names)}
    return OnDemand(where, lambda name: where[name][1].result()[where[name][0]])


def run_offline(workers: VLLMWorkers, models: list[Path], prompts: list[list[int]], out_dir: Path, *extra: str,
                timeout: int = 1200) -> list[dict]:
    """submit_offline, waited for."""
    return submit_offline(workers, models, prompts, out_dir, *extra, timeout=timeout).result()


__all__ = ["PLANS", "REPO", "VLLMWorkers", "results_of", "run_offline", "submit_offline", "vllm_env"]
