"""How a pretrained-model comparison is shown: the table (perplexity per text, its ratio to the teacher's bf16 row
with a 95% paired bootstrap interval over the windows, KV bytes per token, task accuracies), perplexity against
KV bytes per token (one panel per text) and each uptrained model's recovery curve. The rows come from
`fusedkv.experiments.pretrained`."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..utils import save_figure, write_json_atomic, write_text_atomic
from .pretrained import TEACHER


def paired_interval(rows: list[float], refs: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the perplexity ratio exp(mean(row) - mean(ref)), resampling the
    windows in pairs (both rows scored the same windows, so a window's difficulty cancels)."""
    diffs = torch.tensor(rows, dtype=torch.float64) - torch.tensor(refs, dtype=torch.float64)
    pick = torch.randint(len(diffs), (draws, len(diffs)), generator=torch.Generator().manual_seed(seed))
    lo, hi = torch.quantile(diffs[pick].mean(1), torch.tensor([0.025, 0.975], dtype=torch.float64)).exp().tolist()
    return lo, hi


def label(text: str) -> str:
    """A text's short name for tables: a spec's last part (`heldout:prose` -> prose), a file's stem."""
    return Path(text).stem if "/" in text or "." in text else text.split(":")[-1]


def table(results: list[dict], texts: list[str]) -> str:
    """Perplexity per text, ratio to the teacher's bf16 row (or its first row), and KV bytes per token."""
    ref = next((r for r in results if r["model"] == TEACHER and r["cache"] == "bf16"),
               next((r for r in results if r["model"] == TEACHER), None))
    head = ["row", "plan", "KV cache", "KV bytes / token", "% of bf16 teacher"]
    head += [f"ppl {label(t)}" for t in texts] + ([f"x teacher {label(t)}" for t in texts] if ref else [])
    tasks = sorted({t for r in results for t in r.get("tasks", {})})
    head += [f"{t} acc %" for t in tasks]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    base = ref["kv_bytes_per_token"] if ref else None
    for r in sorted(results, key=lambda r: -r["kv_bytes_per_token"]):
        cells = [r["name"], r["plan"], r["cache"], f"{r['kv_bytes_per_token']:,.0f}",
                 f"{100 * r['kv_bytes_per_token'] / base:.1f}" if base else "-"]
        cells += [f"{r['ppl'][t]:.3f}" for t in texts]
        if ref:
            cells += [_ratio_cell(r, ref, t) for t in texts]
        cells += [f"{100 * r['tasks'][t]:.1f}" if t in r.get("tasks", {}) else "-" for t in tasks]
        lines.append("| " + " | ".join(cells) + " |")
    if tasks:
        lines.append("\nTask accuracies: the local lm-eval tasks (`fusedkv.eval.harness.LOCAL_TASKS`), zero-shot, "
                     "scored by lm-eval on the model's full-sequence forward, which reads no cache; shown on the "
                     "rows with an unquantised cache.")
    return "\n".join(lines)


def _ratio_cell(row: dict, ref: dict, text: str) -> str:
    """The perplexity ratio to the reference row, with its paired per-window bootstrap interval when both rows
    kept their windows' losses."""
    cell = f"{row['ppl'][text] / ref['ppl'][text]:.3f}"
    a, b = row.get("window_loss", {}).get(text), ref.get("window_loss", {}).get(text)
    if row is ref or not a or not b or len(a) != len(b):
        return cell
    lo, hi = paired_interval(a, b)
    return f"{cell} [{lo:.2f}, {hi:.2f}]"


def plot(results: list[dict], texts: list[str], path: Path, title: str) -> None:
    """Quality against KV bytes: one panel per text, perplexity (log) against bytes per token (log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(texts), figsize=(5 * len(texts), 4), squeeze=False)
    for ax, text in zip(axes[0], texts):
        for r in results:
            ax.scatter(r["kv_bytes_per_token"], r["ppl"][text], s=30)
            ax.annotate(r["name"], (r["kv_bytes_per_token"], r["ppl"][text]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("KV cache bytes per token")
        ax.set_ylabel("perplexity")
        ax.set_title(label(text), fontsize=9)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def plot_recovery(results: list[dict], path: Path, title: str) -> bool:
    """Validation loss against uptraining tokens for each uptrained model (False: none has a curve yet)."""
    curves = {r["model"]: r["curve"] for r in results if r.get("curve")}
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, curve in curves.items():
        xs, ys = zip(*curve)
        ax.plot(xs, [math.exp(y) for y in ys], marker="o", ms=3, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("uptraining tokens")
    ax.set_ylabel("validation perplexity")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return True


def write_outputs(spec: dict, results: list[dict], out: Path) -> str:
    texts = list(spec["texts"])
    title = spec.get("description", spec.get("name", "experiment"))
    body = table(results, texts)
    write_json_atomic(out / "results.json", {"experiment": spec.get("name"), "rows": results})
    plot(results, texts, out / "quality_vs_bytes.png", title)
    recovery = plot_recovery(results, out / "recovery.png", title)
    md = (f"# {title}\n\n{body}\n\n![quality against KV bytes](quality_vs_bytes.png)\n"
          + ("\n![recovery](recovery.png)\n" if recovery else ""))
    write_text_atomic(out / "results.md", md)
    return body
