"""Projection time of one decode step under three weight layouts: the measurement behind
`fusedkv.engine.packing` (which layout `pack_for_decode` uses, and `PACKED_MAX_ROWS`, the portable `ProductRule`).

For every layer of a model shape it runs the products a storage layer makes per step (Q, K, V, O,
gate, up, down) on `rows` = batch x new tokens input rows, with the weights laid out:
  * row:    nn.Linear's own [out, in] row-major, one product per projection (transformers' layout);
  * col:    the same matrices stored column-major, one product each;
  * packed: Q|K|V and gate|up each in one column-major buffer, one product per group
            (down stays row-major), which is what `pack_for_decode` builds.
Layouts are timed interleaved in one process and reported as medians and ratios to `row`, with the
bytes streamed per second; the first line gives the ceiling, `torch.sum` over as many bytes.

    python benchmarks/decode_layout.py                   # the `fusedkv bench` shape, 1 thread
    python benchmarks/decode_layout.py --threads 2 --rows 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def _col(w: torch.Tensor) -> torch.Tensor:
    return w.t().contiguous().t()


def run(layers: int, hidden: int, intermediate: int, rows_list: list[int], repeats: int) -> list[dict]:
    torch.manual_seed(0)
    sep = [[torch.randn(hidden, hidden) for _ in range(4)]  # q, k, v, o
           + [torch.randn(intermediate, hidden) for _ in range(2)]  # gate, up
           + [torch.randn(hidden, intermediate)] for _ in range(layers)]  # down
    layouts = {
        "row": [ws for ws in sep],
        "col": [[_col(w) for w in ws[:6]] + [ws[6]] for ws in sep],
        "packed": [[_col(torch.cat(ws[:3])), _col(ws[3]), _col(torch.cat(ws[4:6])), ws[6]] for ws in sep],
    }
    nbytes = sum(w.numel() * w.element_size() for ws in sep for w in ws)
    out = []
    for rows in rows_list:
        x, x_mid = torch.randn(rows, hidden), torch.randn(rows, intermediate)

        def step(ws_per_layer, x=x, x_mid=x_mid):
            for ws in ws_per_layer:
                for w in ws[:-1]:
                    F.linear(x, w)
                F.linear(x_mid, ws[-1])

        times: dict[str, list[float]] = {k: [] for k in layouts}
        for _ in range(repeats):
            for name, ws in layouts.items():  # interleaved
                t0 = time.perf_counter()
                step(ws)
                times[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        for name, t in med.items():
            out.append(dict(rows=rows, layout=name, ms=t * 1e3, vs_row=t / med["row"], gb_s=nbytes / t / 1e9))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=41)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = run(args.layers, args.hidden, args.intermediate, [int(r) for r in args.rows.split(",")], args.repeats)
    print(f"{args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, fp32, "
          f"{args.threads} thread(s), median of {args.repeats}")
    weights = torch.randn(args.layers * (4 * args.hidden * args.hidden + 3 * args.hidden * args.intermediate))
    sums = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        weights.sum()
        sums.append(time.perf_counter() - t0)
    print(f"streaming ceiling: torch.sum over {weights.numel() * 4 / 1e6:.0f} MB runs at "
          f"{weights.numel() * 4 / statistics.median(sums) / 1e9:.1f} GB/s")
    print("| rows | layout | ms per step | vs row | GB/s |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rows']} | {r['layout']} | {r['ms']:.2f} | {r['vs_row']:.2f} | {r['gb_s']:.1f} |")


if __name__ == "__main__":
    main()
