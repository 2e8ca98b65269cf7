"""Draw docs/kivi_wanda_cache.png: validation loss against KV-cache bytes for vanilla and FusedKV under KIVI
and Wanda, from the committed docs/kivi_wanda_main.json (`benchmarks/kivi_wanda_table.py --json`); nothing is
measured here.

    python scripts/plot_kivi_wanda.py [--json docs/kivi_wanda_main.json] [--out docs/kivi_wanda_cache.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def points(rows: list[dict]) -> dict[tuple[str, str], tuple[float, float, float]]:
    """(plan, method) -> (cache vs fp16 vanilla, mean loss, std over checkpoints)."""
    losses: dict[tuple[str, str], list[float]] = defaultdict(list)
    cache: dict[tuple[str, str], float] = {}
    for r in rows:
        key = (r["plan"], r["method"])
        losses[key].append(r["loss"])
        cache[key] = r["cache_vs_fp16_vanilla"]
    return {k: (cache[k], statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0.0)
            for k, v in losses.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=str(ROOT / "docs" / "kivi_wanda_main.json"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "kivi_wanda_cache.png"))
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = points(json.loads(Path(args.json).read_text()))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for plan, color in (("vanilla", "tab:blue"), ("fusedkv", "tab:red")):
        for (p, method), (x, y, s) in sorted(pts.items()):
            if p != plan:
                continue
            marker = "s" if method.startswith("Wanda") else "o"
            ax.errorbar(x, y, yerr=s, fmt=marker, color=color, capsize=3)
            label = method.split(" (")[0]
            wanda = [v[1] for (q, m), v in pts.items() if q == plan and m.startswith("Wanda")]
            right = method.startswith("Wanda")  # Wanda labels right of the points, the higher loss above
            dy = (5 if y == max(wanda) else -9) if right else 0
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(6 if right else -6, dy),
                        ha="left" if right else "right", fontsize=7)
        ax.plot([], [], "o", color=color, label=plan)
    ax.legend(loc="center left")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV-cache bytes vs fp16 vanilla (log scale)")
    ax.set_ylabel("validation loss (mean ± std over 3 seeds)")
    ax.set_title("Quality against cache bytes: KIVI (circles) and Wanda (squares)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(args.out)


if __name__ == "__main__":
    main()
