"""The native paged kernel (`cpu_paged_attention.c`) at the shapes its register-blocked f32 loops take apart:
head sizes that fill 64-channel chunks or leave a partial one (64, 80, 128), blocks of 32 and 64 tokens
(two 16-lane tiles or four), sequence lengths that end mid-tile, GQA groups, 1-2 weighted K and V sources,
transposed and plain key blocks in float32, transposed bfloat16 blocks (the grouped AVX2 loops, with query-head
groups past one chunk of 4) and the AMX-packed blocks of bfloat16 caches; against the
materialised reference in float64. Decode rows and a prefill chunk in one batch, as vLLM sends them. Slots past
a sequence's end hold NaN: a kernel that reads one into its softmax or its values fails. Runs in the project's
environment (no vLLM needed)."""

from __future__ import annotations

import pytest
import torch

from fusedkv.kernels import native
from fusedkv.kernels.reference import materialized_attention
from fusedkv.serving.paged_blocks import (
    AMX_PACKED_KEYS,
    AMX_PACKED_VALUES,
    TRANSPOSED,
    kernel_layout,
    layout_index,
    split_cpu_kv_cache,
)
from fusedkv.serving.paged_native import native_paged_attention, query_rows

pytestmark = pytest.mark.skipif(not native.available(), reason="the native CPU kernels are not built here")


# (key, value) block layouts as vLLM's CPU backend keeps them (`fusedkv.serving.paged_blocks.block_layout`; None: rows).
ROWS, KEYS_TRANSPOSED, AMX = (None, None), (TRANSPOSED, None), (AMX_PACKED_KEYS, AMX_PACKED_VALUES)


def write_blocks(cache_k, cache_v, k, v, table, layout):
    """Token t of a sequence's K/V [S, H_kv, D] into slot t % bs of block table[t // bs] of [num_blocks, H_kv, bs, D]
    caches, each (block, head) in the (key, value) `layout`, as vLLM's CPU backend lays it out."""
    _, h, bs, d = cache_k.shape
    for cache, x, name in ((cache_k, k, layout[0]), (cache_v, v, layout[1])):
        where = (torch.arange(bs * d) if name is None else layout_index(name, bs, d)).view(bs, d)
        for b in range(-(-x.shape[0] // bs)):
            tokens = x[b * bs:(b + 1) * bs]  # [cnt, H, D]
            raw = cache[table[b]].view(h, bs * d)  # the block's storage, raw order
            raw[:, where[:len(tokens)].reshape(-1)] = tokens.transpose(0, 1).reshape(h, -1).to(cache.dtype)


@pytest.mark.parametrize("head_dim,bs,h_q,h_kv", [(64, 32, 4, 4), (80, 32, 4, 2), (128, 64, 2, 1), (64, 64, 8, 2)])
@pytest.mark.parametrize("n_k,n_v", [(2, 2), (1, 1), (2, 1), (1, 2)])
@pytest.mark.parametrize("dtype,layout", [(torch.float32, KEYS_TRANSPOSED), (torch.float32, ROWS),
                                          (torch.bfloat16, AMX), (torch.bfloat16, KEYS_TRANSPOSED)],
                         ids=["f32-transposed", "f32-rows", "bf16-amx", "bf16-transposed"])
def test_paged_kernel_equals_reference(head_dim, bs, h_q, h_kv, n_k, n_v, dtype, layout):
    check_against_reference(head_dim, bs, h_q, h_kv, n_k, n_v, dtype, layout)


# The grouped AVX2 loops (f32 and bf16 "vec" blocks) take a kv head's query heads 4 at a time and 16 channels at a
# time: groups of 6 (a full and a partial chunk of heads) and 12, head sizes that end in half a chunk (40, 72).
@pytest.mark.parametrize("head_dim,bs,h_q,h_kv", [(40, 32, 12, 2), (72, 64, 12, 1), (64, 32, 6, 1)])
@pytest.mark.parametrize("n_k,n_v", [(2, 2), (1, 1)])
@pytest.mark.parametrize("dtype,layout", [(torch.float32, KEYS_TRANSPOSED), (torch.float32, ROWS),
                                          (torch.bfloat16, KEYS_TRANSPOSED)],
                         ids=["f32-transposed", "f32-rows", "bf16-transposed"])
def test_paged_kernel_query_head_groups_equal_reference(head_dim, bs, h_q, h_kv, n_k, n_v, dtype, layout):
    check_against_reference(head_dim, bs, h_q, h_kv, n_k, n_v, dtype, layout)


def test_paged_loops_reports_the_loops_of_this_build():
    """What the benchmarks print as each layer's kernel path: the generic loops for fp8 codes everywhere, and on a
    processor with AVX2 (every one these kernels are built for in practice) no generic loops for f32 / bf16 "vec"
    blocks' values."""
    loops = native.paged_loops(torch.float8_e4m3fn, native.PAGED_KEYS_TRANSPOSED, 64, 32)
    assert loops == ("generic", "generic")
    from fusedkv.utils import cpu_flags

    if "avx2" in cpu_flags() and "fma" in cpu_flags():
        for dtype in (torch.float32, torch.bfloat16):
            scores, values = native.paged_loops(dtype, native.PAGED_KEYS_TRANSPOSED, 64, 32)
            assert scores != "generic" and values != "generic"
        assert native.paged_loops(torch.bfloat16, native.PAGED_ROWS, 64, 32)[0] == "generic"  # keys in rows


def check_against_reference(head_dim, bs, h_q, h_kv, n_k, n_v, dtype, layout):
    g = torch.Generator().manual_seed(head_dim + bs + 10 * n_k + n_v)
    seqs = [(1, 1), (17, 1), (bs, 1), (3 * bs + 5, 1), (2 * bs + 31, 7)]  # (length after this step, query tokens)
    max_blocks = max(-(-s // bs) for s, _ in seqs)
    num_blocks = len(seqs) * max_blocks + 2
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [perm[r * max_blocks:(r + 1) * max_blocks] for r in range(len(seqs))]
    sources = []
    for _ in range(2):
        kv = torch.full((num_blocks, h_kv, bs, 2 * head_dim), float("nan"), dtype=dtype)
        key_cache, value_cache = split_cpu_kv_cache(kv)
        tokens = [tuple(torch.randn(s, h_kv, head_dim, generator=g).to(dtype).double() for _ in range(2))
                  for s, _ in seqs]  # as stored
        for r, (k, v) in enumerate(tokens):
            write_blocks(key_cache, value_cache, k, v, tables[r], layout)
        sources.append((key_cache, value_cache, tokens))
    kw = [torch.rand(h_kv, head_dim, generator=g) + 0.5 for _ in range(n_k)]
    vw = [torch.rand(h_kv, head_dim, generator=g) + 0.5 if n_v == 2 else None for _ in range(n_v)]
    q_lens = [t for _, t in seqs]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([s for s, _ in seqs], dtype=torch.int32)
    q = torch.randn(sum(q_lens), h_q, head_dim, generator=g)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    native_paged_attention(q, [src[0] for src in sources[:n_k]], kw, [src[1] for src in sources[:n_v]], vw,
                           query_rows(qsl, seq_lens, q.shape[0]), torch.tensor(tables, dtype=torch.int32), scale,
                           kernel_layout(layout), out)
    for r, (s, t) in enumerate(seqs):
        ks = [sources[i][2][r][0].transpose(0, 1)[None] for i in range(n_k)]
        vs = [sources[i][2][r][1].transpose(0, 1)[None] for i in range(n_v)]
        qr = q[qsl[r]:qsl[r + 1]].double().transpose(0, 1)[None]
        mask = torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]
        want = materialized_attention(qr, ks, [w.double() for w in kw], vs,
                                      [None if w is None else w.double() for w in vw], mask=mask, scale=scale)
        torch.testing.assert_close(out[qsl[r]:qsl[r + 1]].double(), want[0].transpose(0, 1), atol=2e-5, rtol=2e-5)


def test_query_rows_decode_only_equals_general_path():
    """Decode-only batches take a shortcut in `query_rows`; it must give what the general path gives."""
    g = torch.Generator().manual_seed(0)
    for n in (1, 5, 16):
        seq_lens = torch.randint(1, 300, (n + 3,), generator=g, dtype=torch.int32)  # padded past the requests
        qsl = torch.arange(n + 1, dtype=torch.int32)
        rows = query_rows(qsl, seq_lens, n)
        assert rows[0].tolist() == list(range(n)) and rows[1].tolist() == seq_lens[:n].tolist()
        assert rows[0].dtype == rows[1].dtype == torch.int32 and rows[1].is_contiguous()
        # Not decode only: one request with two tokens, one with none (same token count).
        qsl = torch.tensor([0, 2, *range(2, n + 1)], dtype=torch.int32)[: n + 1]
        if n > 1:
            seq, length = query_rows(qsl, seq_lens, n)
            assert seq[:2].tolist() == [0, 0] and length[:2].tolist() == [seq_lens[0] - 1, seq_lens[0]]


def test_the_selection_gives_soft_capped_and_windowed_fusion_the_native_kernel():
    """Every paged path takes the soft cap and the window (the native kernel too), so neither is asked: a layer fusing
    two K sources gets the native kernel where it is built; one K source stays on vLLM's op."""
    from fusedkv.engine.selection import select_paged_attention

    def path(k_sources):
        return select_paged_attention(k_sources, ["l0", "l1"], gpu=False, head_dim=64, device=torch.device("cpu"),
                                      dtype=torch.float32, query_dtype=torch.float32,
                                      native_layout=native.PAGED_KEYS_TRANSPOSED)

    assert path(["l0", "l1"]) == ("native" if native.available() else "gathered")
    assert path(["l1"]) == "vllm_op"


def test_the_selection_gives_two_source_bf16_layers_on_amx_packed_blocks_the_kernel():
    """vLLM's "amx" ISA packs bf16 caches (keys and values); the kernel reads that packing, so a two-K-source
    layer takes it, not the gathered copies. A layout learned as a general index (none the kernel has) is gathered.
    (Which layout vLLM really uses on an AMX processor: test_paged_layout.py, in the vLLM environment.)"""
    from fusedkv.engine.selection import select_paged_attention

    def path(layout):
        return select_paged_attention(["l0", "l1"], ["l0", "l1"], gpu=False, head_dim=64, device=torch.device("cpu"),
                                      dtype=torch.bfloat16, query_dtype=torch.bfloat16,
                                      native_layout=kernel_layout(layout))

    assert kernel_layout(AMX) == native.PAGED_AMX
    assert path(AMX) == "native"
    assert path(KEYS_TRANSPOSED) == "native" and path(ROWS) == "native"
    shuffled = torch.randperm(32 * 64)
    assert kernel_layout((shuffled, None)) is None and path((shuffled, None)) == "gathered"
    assert kernel_layout((AMX_PACKED_KEYS, None)) is None  # a pair the kernel does not read

