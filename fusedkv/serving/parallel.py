"""How a FusedKV model is split across devices when served: tensor parallel by head, pipeline stages by layer.

Tensor parallel (vLLM's `--tensor-parallel-size`): the plugin's layers are vLLM's parallel layers (QKV / column /
row parallel linears, vocabulary-parallel embedding and head), so each rank holds its query heads and KV heads
(`rank_heads`, vLLM's `QKVParallelLinear` rule: with fewer KV heads than ranks, each KV head is replicated on
tp / H_kv consecutive ranks). The cross-layer fusion (paper Eq. 4-5) is per KV head and per channel, so a
reconstruction layer on a rank fuses exactly its rank's KV heads: its fusion weights are those heads' rows, and
its source layers' caches on that rank hold exactly those heads. Nothing is communicated beyond vLLM's own
all-reduces (after o_proj and the MLP's down projection).

Pipeline parallel: a reconstruction layer reads its storage layers' caches, so a stage boundary may only fall
where no layer reads a source on an earlier stage (`pipeline_splits`); otherwise the sources' K/V would have to
be sent forward every step (or kept twice), which undoes the halving on the later stage. For the half-split
plans that read layer 1 (FusedKV, Lite, dense fusion) no such boundary exists (every upper layer reads layer 1);
for CLA's pairs and YOCO-like plans whose sources sit just below their readers, they do. vLLM 0.32's CPU build
runs no pipeline stages (even its own models stop in the second stage's worker), so the plugin refuses
`--pipeline-parallel-size` > 1 and this placement is what a build that runs stages would use.
"""

from __future__ import annotations

from ..plan import KVSharingPlan


def rank_heads(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> tuple[int, int, slice]:
    """(query heads, KV heads, which of the model's KV heads) of tensor-parallel rank `rank` of `tp`."""
    if num_heads % tp or (num_kv_heads % tp if num_kv_heads >= tp else tp % num_kv_heads):
        raise ValueError(f"tensor parallel size {tp} does not divide the model's {num_heads} query heads and "
                         f"{num_kv_heads} KV heads (nor is a multiple of the KV heads); choose another size")
    per_rank_kv = max(num_kv_heads // tp, 1)
    replicas = max(tp // num_kv_heads, 1)
    first = rank // replicas * per_rank_kv
    return num_heads // tp, per_rank_kv, slice(first, first + per_rank_kv)


def pipeline_splits(plan: KVSharingPlan) -> list[int]:
    """Layer indices b (0 < b < L) where a stage may end before layer b: no layer from b on reads a source below b."""
    lowest_read = [min(layer.sources) for layer in plan.layers]
    return [b for b in range(1, plan.num_layers) if min(lowest_read[b:]) >= b]


def pipeline_stages(plan: KVSharingPlan, stages: int) -> list[range] | None:
    """`stages` contiguous layer ranges, as even as the allowed boundaries make them, each holding every source its
    layers read; None when the plan has too few boundaries (the sources would have to be passed forward)."""
    allowed = pipeline_splits(plan)
    if stages < 1 or len(allowed) < stages - 1:
        return None
    bounds, lo = [], 0
    for s in range(1, stages):
        ideal = plan.num_layers * s / stages
        best = min((b for b in allowed if b > lo and len([a for a in allowed if a > b]) >= stages - 1 - s),
                   key=lambda b: abs(b - ideal), default=None)
        if best is None:
            return None
        bounds.append(best)
        lo = best
    edges = [0, *bounds, plan.num_layers]
    return [range(a, b) for a, b in zip(edges, edges[1:])]
