"""CPU micro-benchmark: decode rows of a sliding-window FusedKV layer over vLLM's paged CPU cache, in the native
paged kernel (`cpu_paged_attention.c`, the window applied in place) against the gathered path those layers took
before the kernel had a window (`CrossLayerAttention._gathered`: every sequence's blocks copied, then
`factored_attention` with the window in the mask).

    .venv/bin/python benchmarks/paged_window_cpu.py [--batch 8] [--seq 2048] [--window 256] [--rounds 5]

2 weighted K + 2 weighted V sources, H_kv 2, G 2, D 64, f32, block 32, keys transposed (vLLM's "vec" ISA
layout), one thread. Each round times every engine (order rotated per round, all warmed up first); printed:
per-round times, per-round ratios to the gathered path, their medians. The kernel without a window is timed
too (its cost grows with the whole sequence, the window's with W).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fusedkv.kernels import native
from fusedkv.kernels.reference import factored_attention
from fusedkv.serving.paged_blocks import TRANSPOSED, gather_blocks
from fusedkv.serving.paged_native import native_paged_attention, query_rows


def engines(batch: int, seq: int, window: int, h_kv: int = 2, g: int = 2, d: int = 64, bs: int = 32) -> dict:
    num_blocks = batch * -(-seq // bs)
    gen = torch.Generator().manual_seed(0)
    table = torch.randperm(num_blocks, generator=gen).view(batch, -1).to(torch.int32)

    def cache():  # a [num_blocks, H_kv, bs, 2 * D] CPU cache split as the backend splits it
        kv = torch.randn(num_blocks, h_kv, bs, 2 * d, generator=gen)
        return kv.view(num_blocks, h_kv, bs * 2, d).chunk(2, dim=2)

    layers = [cache(), cache()]
    keys, values = [c[0] for c in layers], [c[1] for c in layers]
    kw = [torch.rand(h_kv, d, generator=gen) for _ in range(2)]
    vw = [torch.rand(h_kv, d, generator=gen) for _ in range(2)]
    q = torch.randn(batch, h_kv * g, d, generator=gen)
    lens = torch.full((batch,), seq, dtype=torch.int32)
    rows = query_rows(torch.arange(batch + 1, dtype=torch.int32), lens, batch)
    out = torch.empty_like(q)

    def kernel(w):
        return lambda: native_paged_attention(q, keys, kw, values, vw, rows, table, d**-0.5,
                                              native.PAGED_KEYS_TRANSPOSED, out, w, None)

    def gathered():
        k_src = [gather_blocks(c, table, TRANSPOSED) for c in keys]
        v_src = [gather_blocks(c, table, None) for c in values]
        pos = torch.arange(k_src[0].shape[2])[None, :]
        mask = (pos < lens[:, None]) & (pos >= lens[:, None] - window)
        for v in v_src:
            v.masked_fill_(~mask[:, None, :, None], 0)
        return factored_attention(q.unsqueeze(2), k_src, kw, v_src, vw, mask=mask[:, None, None, :], scale=d**-0.5)

    # The engines agree before they are timed.
    kernel(window)()
    torch.testing.assert_close(out, gathered()[:, :, 0], atol=1e-4, rtol=1e-4)
    return {"gathered (window)": gathered, "native (window)": kernel(window), "native (no window)": kernel(None)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5, help="calls per engine per round")
    args = p.parse_args(argv)
    if not native.available():
        print("the native CPU kernels are not built here (a C compiler with OpenMP is needed)")
        return 1
    torch.set_num_threads(1)
    fns = engines(args.batch, args.seq, args.window)
    names = list(fns)
    for fn in fns.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                fns[name]()
            times[name].append((time.perf_counter() - t0) / args.repeats * 1e3)
    base = times[names[0]]
    print(f"batch {args.batch}, {args.seq} keys, window {args.window}, one thread; ms per call per round")
    print("| engine | ms per round | median ms | x faster than gathered, per round | median |")
    print("|---|---|---|---|---|")
    for name in names:
        ratios = [b / t for b, t in zip(base, times[name])]
        print(f"| {name} | {' '.join(f'{t:.2f}' for t in times[name])} | {statistics.median(times[name]):.2f} | "
              f"{' '.join(f'{x:.1f}' for x in ratios)} | {statistics.median(ratios):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
