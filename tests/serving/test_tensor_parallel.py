"""Tensor parallel serving: the plugin's layers are vLLM's parallel layers (QKV / column / row parallel, vocabulary-
parallel embedding and head) and every reconstruction layer fuses only its rank's KV heads (`vllm_model.rank_heads`:
its fusion weights' rows, its sources' caches on that rank). vLLM's CPU build runs tensor_parallel_size=2 on this
machine with one core per rank (VLLM_CPU_OMP_THREADS_BIND="0|1"; without it, its NUMA check stops it). Greedy tokens
at TP=2 must equal the transformers model's in float32, which TP=1 equals (test_vllm_plans.py): FusedKV with one KV
head (replicated on both ranks, vLLM's GQA rule; the native paged kernel) and Lite (two KV heads per rank; vLLM's
op), both with the iterative-free default fusion."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.serving.conftest import REPO, vllm_env

pytestmark = pytest.mark.slow  # two vLLM worker processes per engine


def test_tp2_greedy_tokens_equal_transformers(vllm_python, tmp_path):
    from tiny_checkpoints import reference_outputs, write_checkpoints

    models = {"fusedkv-1kv": write_checkpoints(tmp_path / "a", plans=("fusedkv",), num_key_value_heads=1)["fusedkv"],
              "fusedkv-lite": write_checkpoints(tmp_path / "b", plans=("fusedkv-lite",))["fusedkv-lite"]}
    refs = {name: reference_outputs(path) for name, path in models.items()}
    prompts = [row["prompt_ids"] for row in refs["fusedkv-lite"]["rows"]]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    env = {**vllm_env(), "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    r = subprocess.run([vllm_python, str(Path(__file__).with_name("_tensor_parallel_cases.py")),
                        str(tmp_path / "prompts.json"), *map(str, models.values())], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-6000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for name, path in models.items():
        assert got[str(path)] == [row["tokens"] for row in refs[name]["rows"]], name
