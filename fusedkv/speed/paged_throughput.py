"""Paged decode kernel on one GPU: one decode step over vLLM-layout caches, paged against contiguous.

Part of the GPU benchmark (`fusedkv bench --gpu-suite`). For the Lite (K^n, V^1) and FusedKV (2 weighted K +
2 weighted V sources) cases it times `fusedkv.kernels.triton_paged_decode` reading caches in vLLM's GPU
layout ([num_blocks, H_kv, block_size, 2 * D] split into K and V views) through a shuffled block table,
next to the contiguous kernel (`triton_decode`) on the same tokens laid out [B, H_kv, S, D]: the ratio is
what the per-key block lookup costs. Each case is first checked against the fp32 reference on its own
inputs (at the smallest context); a mismatch makes the suite exit non-zero.
"""

from __future__ import annotations

import functools
import math

import torch

from ..kernels.reference import materialized_attention
from .kernel_throughput import _bench, _fmt, _tolerance, rel_err


def paged_rows(device, dtype, dry_run: bool, block_size: int = 16) -> list[dict]:
    shapes = [("GQA", 8, 2, 16)] if dry_run else [("MHA", 16, 16, 128), ("GQA", 32, 8, 128)]
    contexts = (40,) if dry_run else (8192, 32768)
    batches = (2,) if dry_run else (1, 8)
    rows = []
    for shape in shapes:
        for b in batches:
            for s in contexts:
                rows += _rows_for(device, dtype, dry_run, block_size, shape, b, s, check=s == contexts[0])
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def _gather(cache, table, s):
    """[num_blocks, block_size, H_kv, D] cache, [B, n] table -> the same tokens as [B, H_kv, s, D]."""
    b, n = table.shape
    _, bs, h_kv, d = cache.shape
    return cache[table.long()].reshape(b, n * bs, h_kv, d)[:, :s].transpose(1, 2).contiguous()


def _rows_for(device, dtype, dry_run, block_size, shape, b, s, check) -> list[dict]:
    from ..kernels import fused_decode_attention
    from ..kernels.triton_paged_decode import paged_decode_attention

    shape_name, h_q, h_kv, d = shape
    elem = torch.tensor([], dtype=dtype).element_size()
    gen = torch.Generator(device=device).manual_seed(2)
    n = -(-s // block_size)
    table = torch.randperm(b * n, device=device, generator=gen).view(b, n).to(torch.int32)
    lens = torch.full((b,), s, dtype=torch.int32, device=device)
    layers = [torch.empty(b * n, h_kv, block_size, 2 * d, device=device, dtype=dtype).normal_(generator=gen)
              for _ in range(3)]
    split = [kv.transpose(1, 2).split(d, dim=-1) for kv in layers]  # vLLM's K and V views of each layer
    q = torch.empty(b, h_q, d, device=device, dtype=dtype).normal_(generator=gen)
    kw = [torch.randn(h_kv, d, device=device) for _ in range(2)]
    vw = [torch.randn(h_kv, d, device=device) for _ in range(2)]
    plans = {"Lite (K^n,V^1)": ([split[1][0]], None, [split[0][1]], None),
             "FusedKV (2K+2V, weighted)": ([split[1][0], split[2][0]], kw, [split[0][1], split[1][1]], vw)}
    rows = []
    for plan, (ks, k_w, vs, v_w) in plans.items():
        cks, cvs = [_gather(c, table, s) for c in ks], [_gather(c, table, s) for c in vs]
        cases = {"paged": functools.partial(paged_decode_attention, q, ks, k_w, vs, v_w, table, lens),
                 "contiguous": functools.partial(fused_decode_attention, q, cks, k_w, cvs, v_w)}
        nbytes = (len(ks) + len(vs)) * b * h_kv * s * d * elem + 2 * q.numel() * elem
        times = {}
        for layout, fn in cases.items():
            row = {"section": "paged", "shape": shape_name, "B": b, "S": s, "H_q": h_q, "H_kv": h_kv, "D": d,
                   "dtype": str(dtype).replace("torch.", ""), "kernel": f"{layout} {plan}"}
            if check:
                ref = materialized_attention(q.float()[:, :, None], [x.float() for x in cks], k_w,
                                             [x.float() for x in cvs], v_w)[:, :, 0]
                err = rel_err(fn(), ref)
                row.update(rel_err=err, ok=bool(math.isfinite(err) and err < _tolerance(dtype)))
            times[layout] = _bench(fn, device, dry_run)
            row.update(us=times[layout] * 1e3, gbps=nbytes / (times[layout] * 1e-3) / 1e9)
            rows.append(row)
        rows[-2]["vs_contiguous"] = times["contiguous"] / times["paged"]
    return rows


def format_paged(rows: list[dict]) -> str:
    lines = ["### Paged decode (vLLM block tables, block 16) vs contiguous", "",
             "| shape | B | S | kernel | us | GB/s | paged vs contiguous (>1: faster) | rel. err |", "|---" * 8 + "|"]
    for r in rows:
        err = "" if "rel_err" not in r else f"{r['rel_err']:.1e}" + ("" if r["ok"] else " **WRONG**")
        lines.append(f"| {r['shape']} H_q={r['H_q']} H_kv={r['H_kv']} D={r['D']} | {r['B']} | {r['S']} | "
                     f"{r['kernel']} | {_fmt(r['us'], '.1f')} | {_fmt(r['gbps'], '.0f')} | "
                     f"{_fmt(r.get('vs_contiguous'), '.2f')} | {err} |")
    return "\n".join(lines)
