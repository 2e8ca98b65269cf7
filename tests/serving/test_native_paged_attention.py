"""The native kernel that FusedKV reconstruction layers use over vLLM's paged CPU cache
(`cpu_paged_attention.c` through `fusedkv.serving.paged_native.native_paged_attention`) equals the plain
reference: materialised fused K/V, then softmax attention, per sequence with its causal rows.

The cache is laid out as vLLM's CPU backend lays it out ([num_blocks, H_kv, block, 2 * D], keys in
plain rows or transposed blocks, or keys and values AMX-packed as its "amx" ISA keeps bf16 caches;
`test_paged_layout.py` checks those layouts against vLLM's own write op), with a shuffled block table, and one
batch mixes decode rows, a prefill chunk that starts mid-sequence, and a one-token sequence; slots no sequence
wrote hold NaN. With a sliding window and Gemma 2's soft cap the reference is plain float64 attention (fused K/V
materialised, a masked softmax), and the blocks wholly left of every row's window hold NaN too (never read).
Runs in the project's environment (no vLLM needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fusedkv.kernels import native
from fusedkv.kernels.reference import materialized_attention
from fusedkv.serving.paged_blocks import kernel_layout, split_cpu_kv_cache
from fusedkv.serving.paged_native import native_paged_attention, query_rows
from tests.conftest import tiered
from tests.serving.test_paged_kernel_shapes import AMX, KEYS_TRANSPOSED, ROWS, write_blocks

pytestmark = pytest.mark.skipif(not native.available(), reason="the native CPU kernels are not built here")

BS, D, H_KV, H_Q = 32, 32, 2, 4
SEQS = [(70, 1), (40, 5), (1, 1), (33, 33)]  # (sequence length after this step, query tokens this step)


def paged_cache(num_blocks: int, dtype, layout, tokens: dict[int, tuple[torch.Tensor, torch.Tensor]],
                tables: list[list[int]]):
    """A vLLM CPU cache tensor holding each sequence's K/V [S, H_kv, D] in its blocks (the rest NaN)."""
    kv = torch.full((num_blocks, H_KV, BS, 2 * D), float("nan"), dtype=dtype)
    key_cache, value_cache = split_cpu_kv_cache(kv)
    for r, (k, v) in tokens.items():
        write_blocks(key_cache, value_cache, k, v, tables[r], layout)
    return key_cache, value_cache


def random_batch(dtype, layout, n_k: int, n_v: int, weighted: bool, seed: int) -> SimpleNamespace:
    """SEQS in paged caches (two layers, each sequence's blocks shuffled), fusion weights, the batch's queries."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-s // BS) for s, _ in SEQS)
    num_blocks = len(SEQS) * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [perm[r * max_blocks:(r + 1) * max_blocks] for r in range(len(SEQS))]
    sources = [{r: (torch.randn(s, H_KV, D, generator=g), torch.randn(s, H_KV, D, generator=g))
                for r, (s, _) in enumerate(SEQS)} for _ in range(2)]
    caches = [paged_cache(num_blocks, dtype, layout, src, tables) for src in sources]
    q_lens = [t for _, t in SEQS]
    return SimpleNamespace(
        tables=tables, block_table=torch.tensor(tables, dtype=torch.int32), sources=sources, caches=caches,
        keys=[c[0] for c in caches[:n_k]], values=[c[1] for c in caches[:n_v]],
        kw=[torch.rand(H_KV, D, generator=g) + 0.5 if weighted else None for _ in range(n_k)],
        vw=[torch.rand(H_KV, D, generator=g) + 0.5 if weighted else None for _ in range(n_v)],
        q=torch.randn(sum(q_lens), H_Q, D, generator=g),
        qsl=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor([s for s, _ in SEQS], dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", [KEYS_TRANSPOSED, ROWS, AMX], ids=["transposed", "rows", "amx"])
@pytest.mark.parametrize("n_k,n_v,weighted", [(2, 2, True), (1, 1, False), (2, 1, True), (1, 2, False)])
def test_native_paged_attention_equals_materialised_reference(dtype, layout, n_k, n_v, weighted):
    b = random_batch(dtype, layout, n_k, n_v, weighted, seed=0)
    q, qsl, kw, vw, sources = b.q, b.qsl, b.kw, b.vw, b.sources
    out = torch.full_like(q, float("nan"))
    scale = D**-0.5
    assert native_paged_attention(q, b.keys, kw, b.values, vw, query_rows(qsl, b.seq_lens, q.shape[0]), b.block_table,
                                  scale, kernel_layout(layout), out) is out
    for r, (s, t) in enumerate(SEQS):
        # The reference reads the tokens as stored (rounded to the cache dtype) and attends causally.
        ks = [sources[i][r][0].to(dtype).float().transpose(0, 1)[None] for i in range(n_k)]
        vs = [sources[i][r][1].to(dtype).float().transpose(0, 1)[None] for i in range(n_v)]
        qr = q[qsl[r]:qsl[r + 1]].transpose(0, 1)[None]
        mask = torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]
        want = materialized_attention(qr, ks, kw, vs, vw, mask=mask, scale=scale)[0].transpose(0, 1)
        torch.testing.assert_close(out[qsl[r]:qsl[r + 1]], want, atol=2e-5, rtol=2e-5)


# Windows: 1 (the row's own key), inside a block, one block exactly (32), over a block boundary, longer than every
# sequence; soft cap alone and with a window. Sequences as SEQS: 70 (decode), 40 (a chunk of 5), 1, 33 (a prompt).
WINDOW_CASES = [(20, None), (1, None), (32, 2.0), (45, 2.0), (100, None), (None, 2.0)]
LAYOUTS = {"transposed": KEYS_TRANSPOSED, "rows": ROWS, "amx": AMX}


# The fast tier: f32 with transposed keys and bf16 AMX-packed (the register-blocked loops), every window.
@pytest.mark.parametrize("dtype, layout, window, softcap", tiered(
    [(dtype, layout, *case) for dtype in (torch.float32, torch.bfloat16) for layout in LAYOUTS.values()
     for case in WINDOW_CASES],
    lambda dtype, layout, window, softcap: (dtype, layout) in [(torch.float32, KEYS_TRANSPOSED), (torch.bfloat16, AMX)],
    lambda dtype, layout, window, softcap: "-".join(
        [str(dtype)[6:], *[name for name, v in LAYOUTS.items() if v == layout], f"w{window}", f"cap{softcap}"])))
@pytest.mark.parametrize("n_k,n_v,weighted", [(2, 2, True), (1, 2, False)])
def test_native_paged_attention_window_and_softcap_equal_float64(dtype, layout, window, softcap, n_k, n_v, weighted):
    b = random_batch(dtype, layout, n_k, n_v, weighted, seed=1)
    q, qsl, kw, vw, sources = b.q, b.qsl, b.kw, b.vw, b.sources
    if window:  # blocks wholly left of every query row's window: a window layer never needs them
        for r, (s, t) in enumerate(SEQS):
            for blk in range(max(s - t + 1 - window, 0) // BS):
                for cache in (c for pair in b.caches for c in pair):
                    cache[b.tables[r][blk]] = float("nan")
    out = torch.full_like(q, float("nan"))
    scale = 0.5  # scores of several units: a cap of 2 changes the attention a lot
    native_paged_attention(q, b.keys, kw, b.values, vw, query_rows(qsl, b.seq_lens, q.shape[0]), b.block_table, scale,
                           kernel_layout(layout), out, window, softcap)

    def fused(side, count, weights, r):  # [H_kv, S, D] float64, the tokens as stored (rounded to the cache dtype)
        return sum(sources[i][r][side].to(dtype).double().transpose(0, 1) * (1 if w is None else w.double()[:, None])
                   for i, w in zip(range(count), weights))

    for r, (s, t) in enumerate(SEQS):
        k = fused(0, n_k, kw, r).repeat_interleave(H_Q // H_KV, 0)
        v = fused(1, n_v, vw, r).repeat_interleave(H_Q // H_KV, 0)
        scores = scale * q[qsl[r]:qsl[r + 1]].double().transpose(0, 1) @ k.transpose(1, 2)  # [H_q, t, s]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos, k_pos = torch.arange(s - t, s)[:, None], torch.arange(s)[None, :]
        mask = (k_pos <= q_pos) & ((q_pos - k_pos < window) if window else True)
        want = (torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v).transpose(0, 1)
        torch.testing.assert_close(out[qsl[r]:qsl[r + 1]].double(), want, atol=3e-5, rtol=3e-5)
