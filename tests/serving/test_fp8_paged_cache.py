"""FusedKV and Lite reconstruction layers over vLLM's 8-bit KV caches (`--kv-cache-dtype fp8` / `fp8_e4m3` /
`fp8_e5m2`): the storage layers' blocks hold fp8(x / scale) as vLLM writes them (`quantize_fp8`, one scale per
layer for keys and one for values), and every attention path of a reconstruction layer reads the codes in place
and dequantises them with the source layers' scales (folded into the fusion weights: `KVSources.scaled`). Each path
must equal plain attention over the same quantised cache dequantised (`dequantize_fp8`): what fusedkv computes for
the model with that cache.

vLLM's CPU build cannot run an fp8 cache on this processor class (AVX2: "FP8 KV cache on CPU requires x86 with
AVX-512 or AMX", and its AVX2 extension has no fp8 kernels), so these tests check the paths themselves, in the
project's environment: the native CPU kernel over vLLM's CPU block layouts, the gathered path over the GPU layout,
and the paged Triton kernel under TRITON_INTERPRET=1 (`_fp8_triton_cases.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusedkv.kernels import native
from fusedkv.kernels.reference import materialized_attention
from fusedkv.model.fusion import KVSources
from fusedkv.serving.paged_blocks import (
    FP8_FORMATS,
    dequantize_fp8,
    kernel_layout,
    quantize_fp8,
    split_cpu_kv_cache,
)
from fusedkv.serving.paged_native import native_paged_attention, query_rows
from fusedkv.serving.paged_triton import paged_cross_layer_attention
from tests.serving.test_paged_kernel_shapes import KEYS_TRANSPOSED, ROWS, write_blocks

BS, D, H_KV, H_Q = 32, 32, 2, 4
SEQS = [(70, 1), (40, 5), (1, 1), (33, 33)]  # (sequence length after this step, query tokens this step)
SCALES = {"k": [0.05, 0.2], "v": [0.1, 0.03]}  # per source layer (vLLM keeps one float per layer and side)


def with_scales(weights: list, scales: list[float], h_kv: int, d: int) -> list:
    """One side's fusion weights with each source layer's scale folded in, as a served layer folds them."""
    return list(KVSources((), tuple(weights), (), ()).scaled(scales, (), (h_kv, d)).key_weights)


def batch(fmt: torch.dtype, seed: int):
    """Two source layers' K/V per sequence, quantised as vLLM writes them, and their dequantised values."""
    g = torch.Generator().manual_seed(seed)
    codes, plain = [], []
    for i in range(2):
        k, v = ({r: quantize_fp8(torch.randn(s, H_KV, D, generator=g), fmt, SCALES[side][i])
                 for r, (s, _) in enumerate(SEQS)} for side in "kv")
        codes.append((k, v))
        plain.append(({r: dequantize_fp8(x, SCALES["k"][i]) for r, x in k.items()},
                      {r: dequantize_fp8(x, SCALES["v"][i]) for r, x in v.items()}))
    q_lens = [t for _, t in SEQS]
    q = torch.randn(sum(q_lens), H_Q, D, generator=g)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    weights = [torch.rand(H_KV, D, generator=g) + 0.5 for _ in range(4)]
    return codes, plain, q, qsl, weights


def reference(plain, q, qsl, kw, vw, n_k, n_v, scale):
    out = torch.empty_like(q)
    for r, (s, t) in enumerate(SEQS):
        ks = [plain[i][0][r].transpose(0, 1)[None] for i in range(n_k)]
        vs = [plain[i][1][r].transpose(0, 1)[None] for i in range(n_v)]
        mask = torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]
        out[qsl[r]:qsl[r + 1]] = materialized_attention(q[qsl[r]:qsl[r + 1]].transpose(0, 1)[None], ks, kw, vs, vw,
                                                        mask=mask, scale=scale)[0].transpose(0, 1)
    return out


def tables_for(g_seed: int):
    max_blocks = max(-(-s // BS) for s, _ in SEQS)
    num_blocks = len(SEQS) * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(g_seed)).tolist()
    return num_blocks, [perm[r * max_blocks:(r + 1) * max_blocks] for r in range(len(SEQS))]


@pytest.mark.skipif(not native.available(), reason="the native CPU kernels are not built here")
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("layout", [KEYS_TRANSPOSED, ROWS], ids=["transposed", "rows"])
@pytest.mark.parametrize("n_k,n_v", [(2, 2), (1, 2)])  # FusedKV; Lite-like (one K source, two V)
def test_native_kernel_reads_fp8_blocks_in_place(kv_cache_dtype, layout, n_k, n_v):
    fmt = FP8_FORMATS[kv_cache_dtype]
    codes, plain, q, qsl, weights = batch(fmt, seed=3)
    num_blocks, tables = tables_for(3)
    caches = []
    for k, v in codes:  # vLLM's CPU cache: uint8 [blocks, H_kv, bs, 2D], the codes; unwritten slots NaN codes
        kv = torch.full((num_blocks, H_KV, BS, 2 * D), 0x7F, dtype=torch.uint8)
        key_cache, value_cache = (c.view(fmt) for c in split_cpu_kv_cache(kv))
        for r in range(len(SEQS)):
            write_blocks(key_cache, value_cache, k[r], v[r], tables[r], layout)
        caches.append((key_cache, value_cache))
    kw, vw = weights[:n_k], weights[2:2 + n_v]
    scale = D ** -0.5
    out = torch.full_like(q, float("nan"))
    seq_lens = torch.tensor([s for s, _ in SEQS], dtype=torch.int32)
    native_paged_attention(q, [c[0] for c in caches[:n_k]], with_scales(kw, SCALES["k"][:n_k], H_KV, D),
                           [c[1] for c in caches[:n_v]], with_scales(vw, SCALES["v"][:n_v], H_KV, D),
                           query_rows(qsl, seq_lens, q.shape[0]), torch.tensor(tables, dtype=torch.int32), scale,
                           kernel_layout(layout), out)
    torch.testing.assert_close(out, reference(plain, q, qsl, kw, vw, n_k, n_v, scale), atol=2e-5, rtol=2e-5)


def gpu_layout_caches(codes, fmt, num_blocks, tables):
    """vLLM's GPU cache layout ([blocks, H_kv, bs, 2D] split into [blocks, bs, H_kv, D] views), codes in place."""
    caches = []
    for k, v in codes:
        kv = torch.full((num_blocks, H_KV, BS, 2 * D), 0x7F, dtype=torch.uint8).view(fmt)
        key_cache, value_cache = kv.transpose(1, 2).split(D, dim=-1)
        for r, (s, _) in enumerate(SEQS):
            for t in range(s):
                key_cache[tables[r][t // BS], t % BS] = k[r][t]
                value_cache[tables[r][t // BS], t % BS] = v[r][t]
        caches.append((key_cache, value_cache))
    return caches


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_gathered_path_dequantises_fp8_blocks(kv_cache_dtype):
    """The gathered path (GPU batches without the kernel, prefill chunks): decode rows and chunks over fp8 blocks."""
    fmt = FP8_FORMATS[kv_cache_dtype]
    codes, plain, q, qsl, weights = batch(fmt, seed=4)
    num_blocks, tables = tables_for(4)
    caches = gpu_layout_caches(codes, fmt, num_blocks, tables)
    kw, vw = weights[:2], weights[2:]
    scale = D ** -0.5
    seq_lens = torch.tensor([s for s, _ in SEQS], dtype=torch.int32)
    out = paged_cross_layer_attention(q, [c[0] for c in caches], with_scales(kw, SCALES["k"], H_KV, D),
                                      [c[1] for c in caches], with_scales(vw, SCALES["v"], H_KV, D), qsl,
                                      seq_lens, torch.tensor(tables, dtype=torch.int32), scale, use_kernel=False)
    torch.testing.assert_close(out, reference(plain, q, qsl, kw, vw, 2, 2, scale), atol=2e-5, rtol=2e-5)


@pytest.mark.slow  # Triton's interpreter in a subprocess (it must be on before Triton is first imported)
def test_paged_triton_kernel_reads_fp8_blocks_under_the_interpreter():
    pytest.importorskip("triton")
    case = Path(__file__).with_name("_fp8_triton_cases.py")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, str(case)], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "ALL OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
