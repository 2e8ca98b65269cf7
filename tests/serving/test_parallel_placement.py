"""How a served model is split (`fusedkv.serving.parallel`): tensor-parallel ranks get their heads by vLLM's
`QKVParallelLinear` rule (KV heads replicated when fewer than ranks), and pipeline stages end only where every
layer's sources are on its own stage. Runs without vLLM (TP=2 served: test_tensor_parallel.py)."""

from __future__ import annotations

import pytest

from fusedkv.plan import build_plan
from fusedkv.serving.parallel import pipeline_splits, pipeline_stages, rank_heads


@pytest.mark.parametrize("tp,heads,kv_heads,want", [
    (1, 4, 2, [(4, 2, slice(0, 2))]),
    (2, 4, 4, [(2, 2, slice(0, 2)), (2, 2, slice(2, 4))]),
    (2, 4, 1, [(2, 1, slice(0, 1)), (2, 1, slice(0, 1))]),  # one KV head: replicated on both ranks
    (4, 8, 2, [(2, 1, slice(0, 1)), (2, 1, slice(0, 1)), (2, 1, slice(1, 2)), (2, 1, slice(1, 2))]),
])
def test_rank_heads_follow_vllms_replication_rule(tp, heads, kv_heads, want):
    assert [rank_heads(heads, kv_heads, tp, rank) for rank in range(tp)] == want


@pytest.mark.parametrize("tp,heads,kv_heads", [(3, 4, 2), (2, 3, 3), (4, 8, 3)])
def test_rank_heads_refuses_uneven_splits(tp, heads, kv_heads):
    with pytest.raises(ValueError, match="does not divide"):
        rank_heads(heads, kv_heads, tp, 0)


def stage_sources_are_local(plan, stages) -> bool:
    where = {i: s for s, layers in enumerate(stages) for i in layers}
    return all(where[src] == where[layer.index] for layer in plan.layers for src in layer.sources)


def test_pipeline_stages_keep_every_source_on_its_readers_stage():
    # Vanilla: every boundary; two stages split the layers evenly.
    vanilla = build_plan("vanilla", 8)
    assert pipeline_splits(vanilla) == list(range(1, 8))
    assert pipeline_stages(vanilla, 2) == [range(0, 4), range(4, 8)]
    # CLA pairs (1 reads 0, 3 reads 2, ...): boundaries between pairs only.
    cla = build_plan("cla", 8)
    assert all(b % 2 == 0 for b in pipeline_splits(cla))
    stages = pipeline_stages(cla, 2)
    assert stages == [range(0, 4), range(4, 8)] and stage_sources_are_local(cla, stages)
    # FusedKV and Lite read layer 1 (index 0) from every upper layer: no boundary keeps the sources local, so their
    # stages would have to pass the sources' K/V forward (not placed: None).
    for name in ("fusedkv", "fusedkv-lite"):
        plan = build_plan(name, 8)
        assert pipeline_splits(plan) == [] and pipeline_stages(plan, 2) is None, name
    assert pipeline_stages(build_plan("fusedkv", 8), 1) == [range(0, 8)]


def test_cpu_tensor_parallel_binds_each_rank_to_its_own_cores(monkeypatch):
    """`fusedkv serve -- -tp N` on vLLM's CPU build sets VLLM_CPU_OMP_THREADS_BIND (vLLM's NUMA check stops without
    it on one NUMA node): this process's cores split evenly, ranks separated by '|'."""
    import os

    from fusedkv.errors import UsageError
    from fusedkv.serving.command import cpu_binding

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    assert cpu_binding(2) == "0,1|2,3"
    assert cpu_binding(1) == "0,1,2,3,4"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert cpu_binding(2) == "0|1"
    with pytest.raises(UsageError, match="its own cores"):
        cpu_binding(3)
