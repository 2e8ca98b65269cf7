"""The paged-cache gather of FusedKV reconstruction layers reads what vLLM's CPU backend wrote
(`_paged_layout_cases.py`), and on processors with AMX tiles the native kernel reads vLLM's AMX-packed bfloat16
blocks in place, is selected for them, and serves FusedKV with the gathered path's greedy tokens
(`_amx_native_cases.py`); both run by the session's vLLM worker: the vLLM environment's Python."""

import json
from pathlib import Path

import pytest
import torch


@pytest.mark.slow  # vLLM's own cache writes, in the vLLM environment: the full suite's
def test_gathered_blocks_equal_the_tokens_vllm_wrote(vllm_workers):
    r = vllm_workers.run(script=str(Path(__file__).with_name("_paged_layout_cases.py")), timeout=300)
    assert r["rc"] == 0 and "ALL OK" in r["stdout"], r["stdout"][-2000:] + r["log"][-2000:] + r["error"][-2000:]


@pytest.mark.slow
@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(),
                    reason="vLLM's CPU backend packs bfloat16 caches for AMX only on processors with AMX tiles")
def test_amx_packed_bf16_caches_are_read_in_place(vllm_workers, checkpoints):
    script = Path(__file__).with_name("_amx_native_cases.py")
    models = [str(checkpoints[plan]) for plan in ("fusedkv", "fusedkv-gqa")]
    code = f"import runpy, sys; sys.argv = {json.dumps([str(script), *models])}; runpy.run_path(sys.argv[0], " \
           "run_name='__main__')"
    r = vllm_workers.run(code=code, timeout=900)
    assert r["rc"] == 0 and "ALL OK" in r["stdout"], r["stdout"][-2000:] + r["log"][-2000:] + r["error"][-2000:]
