"""Run by test_fp8_paged_cache.py with TRITON_INTERPRET=1: the paged Triton decode kernel over vLLM's fp8 caches
(GPU layout, codes viewed as float8) equals plain attention over the dequantised cache, decode rows of FusedKV
(two K, two V sources) and of a Lite-like layer (one K, two V)."""

import torch

from fusedkv.kernels.triton_paged_decode import paged_decode_attention
from fusedkv.serving.paged_blocks import FP8_FORMATS
from tests.serving import test_fp8_paged_cache as cases
from tests.serving.test_fp8_paged_cache import with_scales

for kv_cache_dtype in ("fp8", "fp8_e5m2"):
    fmt = FP8_FORMATS[kv_cache_dtype]
    codes, plain, q, qsl, weights = cases.batch(fmt, seed=5)
    num_blocks, tables = cases.tables_for(5)
    caches = cases.gpu_layout_caches(codes, fmt, num_blocks, tables)
    decode = [r for r, (_, t) in enumerate(cases.SEQS) if t == 1]  # the kernel takes one query row per sequence
    rows = torch.tensor([int(qsl[r]) for r in decode])
    for n_k, n_v in ((2, 2), (1, 2)):
        kw, vw = weights[:n_k], weights[2:2 + n_v]
        scale = cases.D ** -0.5
        got = paged_decode_attention(
            q[rows], [c[0] for c in caches[:n_k]], with_scales(kw, cases.SCALES["k"][:n_k], cases.H_KV, cases.D),
            [c[1] for c in caches[:n_v]], with_scales(vw, cases.SCALES["v"][:n_v], cases.H_KV, cases.D),
            torch.tensor([tables[r] for r in decode], dtype=torch.int32),
            torch.tensor([cases.SEQS[r][0] for r in decode], dtype=torch.int32), scale)
        want = cases.reference(plain, q, qsl, kw, vw, n_k, n_v, scale)[rows]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        print(kv_cache_dtype, n_k, n_v, "ok")

print("ALL OK")
