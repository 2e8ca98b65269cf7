"""The native kernel that FusedKV reconstruction layers use over vLLM's paged CPU cache
(`cpu_paged_attention.c` through `fusedkv.serving.paged.native_paged_attention`) equals the plain
reference: materialised fused K/V, then softmax attention, per sequence with its causal rows.

The cache is laid out as vLLM's CPU backend lays it out ([num_blocks, H_kv, block, 2 * D], keys in
plain rows or transposed blocks, or keys and values AMX-packed as its "amx" ISA keeps bf16 caches;
`test_paged_layout.py` checks those layouts against vLLM's own write op), with a shuffled block table, and one
batch mixes decode rows, a prefill chunk that starts mid-sequence, and a one-token sequence; slots no sequence
wrote hold NaN. Runs in the project's environment (no vLLM needed)."""

from __future__ import annotations

import pytest
import torch

from fusedkv.kernels import native
from fusedkv.kernels.reference import materialized_attention
from fusedkv.serving.paged import kernel_layout, native_paged_attention, query_rows, split_cpu_kv_cache
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", [KEYS_TRANSPOSED, ROWS, AMX], ids=["transposed", "rows", "amx"])
@pytest.mark.parametrize("n_k,n_v,weighted", [(2, 2, True), (1, 1, False), (2, 1, True), (1, 2, False)])
def test_native_paged_attention_equals_materialised_reference(dtype, layout, n_k, n_v, weighted):
    g = torch.Generator().manual_seed(0)
    max_blocks = max(-(-s // BS) for s, _ in SEQS)
    num_blocks = len(SEQS) * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [perm[r * max_blocks:(r + 1) * max_blocks] for r in range(len(SEQS))]
    block_table = torch.tensor(tables, dtype=torch.int32)
    sources = [{r: (torch.randn(s, H_KV, D, generator=g), torch.randn(s, H_KV, D, generator=g))
                for r, (s, _) in enumerate(SEQS)} for _ in range(2)]
    caches = [paged_cache(num_blocks, dtype, layout, src, tables) for src in sources]
    keys, values = [c[0] for c in caches[:n_k]], [c[1] for c in caches[:n_v]]
    kw = [torch.rand(H_KV, D, generator=g) + 0.5 if weighted else None for _ in range(n_k)]
    vw = [torch.rand(H_KV, D, generator=g) + 0.5 if weighted else None for _ in range(n_v)]
    q_lens = [t for _, t in SEQS]
    q = torch.randn(sum(q_lens), H_Q, D, generator=g)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([s for s, _ in SEQS], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    scale = D**-0.5
    assert native_paged_attention(q, keys, kw, values, vw, query_rows(qsl, seq_lens, q.shape[0]), block_table, scale,
                                  kernel_layout(layout), out) is out
    for r, (s, t) in enumerate(SEQS):
        # The reference reads the tokens as stored (rounded to the cache dtype) and attends causally.
        ks = [sources[i][r][0].to(dtype).float().transpose(0, 1)[None] for i in range(n_k)]
        vs = [sources[i][r][1].to(dtype).float().transpose(0, 1)[None] for i in range(n_v)]
        qr = q[qsl[r]:qsl[r + 1]].transpose(0, 1)[None]
        mask = torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]
        want = materialized_attention(qr, ks, kw, vs, vw, mask=mask, scale=scale)[0].transpose(0, 1)
        torch.testing.assert_close(out[qsl[r]:qsl[r + 1]], want, atol=2e-5, rtol=2e-5)
