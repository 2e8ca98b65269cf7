"""CPU micro-benchmark: factored vs materialised FusedKV decode attention.

    python -m fusedkv.kernels.bench_cpu [--quick]

Decode step (T_q = 1), H = 8 heads (MHA), D = 64, FusedKV sources (2 weighted K + 2 weighted V),
B in {1, 8}, S in {512, 1024, 2048, 4096}, fp32; median of repeats.  The materialised path writes two
fused [B, H, S, D] tensors per call before attending; the factored path only reads the four caches,
so its advantage grows with S*B (memory traffic) -- see :func:`reference.cpu_decode_benchmark`.
"""

from __future__ import annotations

import argparse

import torch

from .reference import cpu_decode_benchmark


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
