"""CPU micro-benchmark: the factored and the materialized decode attention paths, one step (T_q = 1).

    .venv/bin/python benchmarks/attention_paths_cpu.py [--quick] [--threads 1]

H = 8 heads (MHA), D = 64, FusedKV sources (2 weighted K + 2 weighted V), B in {1, 8}, S in {512, 1024,
2048, 4096}, fp32; median of repeats. The materialized path writes two fused [B, H, S, D] tensors per
call before attending; the factored path only reads the four caches, so its advantage grows with S*B
(memory traffic). This is the measurement behind `FACTORED_MAX_QUERY` in `fusedkv/engine/backends.py`;
the figures are in docs/history/results-record.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch

from fusedkv.kernels.reference import factored_attention, materialized_attention


def _median_time(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def cpu_decode_benchmark(
    batches: Sequence[int] = (1, 8),
    contexts: Sequence[int] = (512, 1024, 2048, 4096),
    heads: int = 8,
    head_dim: int = 64,
    repeats: int = 15,
    dtype: torch.dtype = torch.float32,
    verbose: bool = True,
) -> list[dict]:
    """Time factored vs materialised decode (T_q = 1) for FusedKV (2 weighted K + 2 weighted V sources).

    Returns one dict per (B, S) with median times in ms and the speed-up of the factored path.
    """
    torch.manual_seed(0)
    rows = []
    for b in batches:
        for s in contexts:
            q = torch.randn(b, heads, 1, head_dim, dtype=dtype)
            k1, kn, v1, vn = (torch.randn(b, heads, s, head_dim, dtype=dtype) for _ in range(4))
            a1, an, b1, bn = (torch.randn(heads, head_dim, dtype=dtype) for _ in range(4))
            args = (q, [k1, kn], [a1, an], [v1, vn], [b1, bn])
            with torch.inference_mode():
                t_mat = _median_time(lambda: materialized_attention(*args), repeats)  # noqa: B023
                t_fac = _median_time(lambda: factored_attention(*args), repeats)  # noqa: B023
            row = {
                "B": b, "S": s, "H": heads, "D": head_dim,
                "materialized_ms": t_mat * 1e3, "factored_ms": t_fac * 1e3, "speedup": t_mat / t_fac,
            }
            rows.append(row)
            if verbose:
                print(f"B={b:2d} S={s:5d}  materialized {row['materialized_ms']:8.3f} ms  "
                      f"factored {row['factored_ms']:8.3f} ms  speed-up x{row['speedup']:.2f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description="factored vs materialised decode attention on CPU")
    p.add_argument("--quick", action="store_true", help="tiny sizes, 3 repeats (smoke test)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        rows = cpu_decode_benchmark(batches=(1,), contexts=(64,), heads=2, head_dim=16, repeats=3)
    else:
        rows = cpu_decode_benchmark(repeats=args.repeats)
    print("\n| B | S | materialized (ms) | factored (ms) | speed-up |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['B']} | {r['S']} | {r['materialized_ms']:.3f} | {r['factored_ms']:.3f} | "
              f"x{r['speedup']:.2f} |")
    return rows


if __name__ == "__main__":
    main()
