"""Decode-kernel throughput on one GPU: our Triton kernel against PyTorch SDPA, one decode step.

Part of the GPU benchmark (`fusedkv bench --gpu-suite`, `python -m fusedkv.speed.gpu_suite`). At contexts
8k/32k/128k, batch 1 and 8, D=128, for H_q=H_kv=16 (MHA) and H_q=128, H_kv=2 (GQA, paper Fig. 5), it
times our FusedKV case (2 weighted K + 2 weighted V sources), our Lite case (K^n, V^1, no weights), our
one-source case, and SDPA (flash where supported, else efficient) on the plain one-source cache. It
reports time (`triton.testing.do_bench`, median), effective GB/s (bytes of the caches read / time), the
throughput ratio to SDPA on the same shape (> 1: faster), and the same calls replayed in a CUDA graph
(no launch or Python overhead, which otherwise dominates the small cases, but also no L2 flush).
The paper reports its FusedKV kernel 28.4% below MHA on average (Fig. 4); FusedKV reads 2x the bytes of
MHA, Lite 1x. `--tune` adds a sweep of the launch parameters (BLOCK_N, num_warps).

A benchmark of a wrong kernel is worthless, so every timed case is first compared with the fp32
reference on its own inputs (at the smallest context of each shape); a mismatch is reported and makes
the suite exit non-zero. The full correctness matrix lives in the tests (tests/kernels).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..kernels.reference import materialized_attention

Tensor = torch.Tensor


def rel_err(out: Tensor, ref: Tensor) -> float:
    ref = ref.double()
    return ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _bench(fn: Callable[[], object], device: torch.device, dry_run: bool) -> float:
    """Median time of ``fn`` in milliseconds."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    # CPU / interpreter: a handful of wall-clock repeats (the numbers mean nothing, the path runs).
    fn()
    ts = []
    for _ in range(1 if dry_run else 10):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def _bench_graph(fn: Callable[[], object], device: torch.device) -> float:
    """Median ms of ``fn`` replayed in a CUDA graph; NaN when not on CUDA or not capturable."""
    if device.type != "cuda":
        return float("nan")
    import triton.testing

    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median"))
    except Exception:  # a backend that cannot be captured: report no number rather than fail the suite
        return float("nan")


def _sdpa_decode_fn(q4: Tensor, k: Tensor, v: Tensor) -> tuple[Callable[[], Tensor] | None, str]:
    """SDPA for one query token, restricted to FLASH, else EFFICIENT (else CUDNN; MATH off CUDA only).

    GQA shapes use ``enable_gqa=True`` (no repeat of the cache, which would inflate its traffic).
    Returns (callable, backend name) or (None, reason) when no backend accepts the shape.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kw = {"enable_gqa": True} if q4.shape[1] != k.shape[1] else {}
    errors = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
        if backend is SDPBackend.MATH and q4.is_cuda:
            continue  # the math path materialises the score matrix: not a decode kernel baseline

        def fn(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q4, k, v, **kw)

        try:
            fn()
            return fn, backend.name.lower()
        except RuntimeError as e:  # backend does not support this shape / dtype / device
            errors.append(f"{backend.name}: {str(e).splitlines()[0][:60]}")
    return None, "; ".join(errors)


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 2e-2


def throughput_rows(device, dtype, dry_run, kernel, shape_name, h_q, h_kv, d, b, s, check: bool) -> list[dict]:
    """Rows for one (shape, B, S): SDPA on the plain cache, then our 1-source, Lite and FusedKV cases.
    With `check`, each of our cases is first compared with the fp32 reference (row keys rel_err, ok)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    gen = torch.Generator(device=device).manual_seed(1)

    def rnd(*shape):
        return torch.empty(*shape, device=device, dtype=dtype).normal_(generator=gen)

    q = rnd(b, h_q, d)
    k1, kn, v1, vn = (rnd(b, h_kv, s, d) for _ in range(4))
    a1, an, b1, bn = (torch.randn(h_kv, d, device=device) for _ in range(4))
    cache_bytes = b * h_kv * s * d * elem  # one source tensor
    sdpa_fn, sdpa_name = _sdpa_decode_fn(q[:, :, None], k1, v1)
    cases = [
        (f"sdpa {sdpa_name}" if sdpa_fn else "sdpa (unavailable)", 2, sdpa_fn, None),
        ("ours 1-source", 2, lambda: kernel(q, k1, None, v1, None), ([k1], None, [v1], None)),
        ("ours Lite (K^n,V^1)", 2, lambda: kernel(q, kn, None, v1, None), ([kn], None, [v1], None)),
        ("ours FusedKV (2K+2V, weighted)", 4, lambda: kernel(q, [k1, kn], [a1, an], [v1, vn], [b1, bn]),
         ([k1, kn], [a1, an], [v1, vn], [b1, bn])),
    ]
    rows = []
    t_sdpa = t_sdpa_graph = None
    for i, (name, n_tensors, fn, sources) in enumerate(cases):
        row = {"section": "throughput", "shape": shape_name, "B": b, "S": s, "H_q": h_q, "H_kv": h_kv,
               "D": d, "dtype": str(dtype).replace("torch.", ""), "kernel": name}
        if fn is None:
            rows.append({**row, "note": sdpa_name})
            continue
        if check and sources is not None:
            ks, kw, vs, vw = sources
            ref = materialized_attention(q.float()[:, :, None], [x.float() for x in ks], kw,
                                         [x.float() for x in vs], vw)[:, :, 0]
            err = rel_err(fn(), ref)
            row.update(rel_err=err, tol=_tolerance(dtype), ok=bool(math.isfinite(err) and err < _tolerance(dtype)))
            del ref
        ms = _bench(fn, device, dry_run)
        ms_graph = _bench_graph(fn, device)
        nbytes = n_tensors * cache_bytes + 2 * q.numel() * elem  # caches read + q read + out written
        if i == 0:
            t_sdpa, t_sdpa_graph = ms, ms_graph
        row.update(ms=ms, us=ms * 1e3, gbps=nbytes / (ms * 1e-3) / 1e9,
                   vs_sdpa=(t_sdpa / ms) if t_sdpa else float("nan"),
                   graph_us=ms_graph * 1e3, graph_gbps=nbytes / (ms_graph * 1e-3) / 1e9,
                   graph_vs_sdpa=t_sdpa_graph / ms_graph)
        rows.append(row)
    return rows


def kernel_suite(device, dtype, dry_run: bool, kernel=None, contexts=None, batches=None, tune: bool = False):
    """Throughput rows (and sweep rows with `tune`) for the decode kernel `kernel` (default ours)."""
    if kernel is None:
        from ..kernels import fused_decode_attention as kernel
    if contexts is None:
        contexts = (48,) if dry_run else (8192, 32768, 131072)
    if batches is None:
        batches = (1, 2) if dry_run else (1, 8)
    shapes = [("MHA", 2, 2, 16), ("GQA", 8, 2, 16)] if dry_run else [("MHA", 16, 16, 128), ("GQA", 128, 2, 128)]
    rows = []
    for shape_name, h_q, h_kv, d in shapes:
        for b in batches:
            for s in contexts:
                rows += throughput_rows(device, dtype, dry_run, kernel, shape_name, h_q, h_kv, d, b, s,
                                        check=s == contexts[0])
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # the 128k, B=8 caches take 17 GB
    if tune:
        rows += _tune(device, dtype, dry_run)
    return rows


def failed_checks(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("ok") is False]


def _tune(device, dtype, dry_run) -> list[dict]:
    """Sweep (BLOCK_N, num_warps) for the 1-source and FusedKV cases at two mid-size shapes."""
    from ..kernels import fused_decode_attention

    if dry_run:
        shapes, grid = [(2, 2, 1, 64, 16)], [(16, 2), (32, 4)]
    else:
        shapes = [(8, 16, 1, 32768, 128), (1, 2, 64, 32768, 128)]
        grid = [(16, 4), (32, 4), (64, 4), (32, 8), (64, 8), (128, 8)]
    rows = []
    for b, h_kv, g, s, d in shapes:
        gen = torch.Generator(device=device).manual_seed(2)

        def rnd(*shape, gen=gen):
            return torch.empty(*shape, device=device, dtype=dtype).normal_(generator=gen)

        q = rnd(b, h_kv * g, d)
        k1, kn, v1, vn = (rnd(b, h_kv, s, d) for _ in range(4))
        a1, an, b1, bn = (torch.randn(h_kv, d, device=device) for _ in range(4))
        for plan, args in (("1-source", (q, k1, None, v1, None)),
                           ("FusedKV", (q, [k1, kn], [a1, an], [v1, vn], [b1, bn]))):
            for block_n, warps in [*grid, ("auto", "auto")]:
                kw = {} if block_n == "auto" else {"block_n": block_n, "num_warps": warps}
                row = {"section": "tune", "plan": plan, "B": b, "H_q": h_kv * g, "H_kv": h_kv, "S": s,
                       "block_n": block_n, "num_warps": warps}
                try:
                    fn = lambda a=args, k=kw: fused_decode_attention(*a, **k)  # noqa: E731
                    row["us"] = _bench(fn, device, dry_run) * 1e3
                except Exception as e:  # e.g. out of shared memory / registers for this config
                    row["note"] = str(e).splitlines()[0][:60] if str(e) else type(e).__name__
                rows.append(row)
    return rows


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None or math.isnan(x) else f"{x:{spec}}{suffix}"


def format_markdown(rows: list[dict]) -> str:
    """Markdown tables: throughput (with the reference check of each timed case) and the launch sweep."""
    out = []
    thr = [r for r in rows if r["section"] == "throughput"]
    if thr:
        out += ["### Decode throughput (one step, median)", "",
                "| shape | B | S | H_q/H_kv | kernel | time (us) | GB/s | throughput vs SDPA "
                "| graph time (us) | graph GB/s | graph vs SDPA | vs fp32 reference |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in thr:
            if "us" not in r:
                out.append(f"| {r['shape']} | {r['B']} | {r['S']} | {r['H_q']}/{r['H_kv']} | {r['kernel']} | "
                           f"- | - | - ({r.get('note', '')}) | - | - | - | - |")
                continue
            check = "-" if "ok" not in r else f"{r['rel_err']:.1e} {'ok' if r['ok'] else '**WRONG**'}"
            out.append(f"| {r['shape']} | {r['B']} | {r['S']} | {r['H_q']}/{r['H_kv']} | {r['kernel']} | "
                       f"{r['us']:.1f} | {r['gbps']:.0f} | {_fmt(r['vs_sdpa'], '.2f', 'x')} | "
                       f"{_fmt(r['graph_us'], '.1f')} | {_fmt(r['graph_gbps'], '.0f')} | "
                       f"{_fmt(r['graph_vs_sdpa'], '.2f', 'x')} | {check} |")
        out.append("")
    tun = [r for r in rows if r["section"] == "tune"]
    if tun:
        out += ["### Launch sweep", "", "| plan | B | H_q/H_kv | S | BLOCK_N | warps | time (us) |",
                "|---|---|---|---|---|---|---|"]
        for r in tun:
            t = f"{r['us']:.1f}" if "us" in r else f"failed: {r.get('note', '')}"
            out.append(f"| {r['plan']} | {r['B']} | {r['H_q']}/{r['H_kv']} | {r['S']} | {r['block_n']} | "
                       f"{r['num_warps']} | {t} |")
        out.append("")
    return "\n".join(out)
