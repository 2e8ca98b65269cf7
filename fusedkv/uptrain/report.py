"""The uptraining report: teacher / converted-before / after on held-out text, the recovered share of the
conversion gap, the KV cache per token, and the curves (OUT/report.md, report.json, curves.png).

The recovered share is (before - after) / (before - teacher), in loss (nats per token): 1 means the
converted model is back at the teacher's loss, 0 that training recovered nothing, above 1 that it passed
the teacher (possible on held-out text of the training distribution); undefined when conversion cost
nothing (before <= teacher).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..train.distill import teacher_student_configs
from ..utils import save_figure, write_json_atomic, write_text_atomic


def recovered_share(teacher: float, before: float, after: float) -> float | None:
    gap = before - teacher
    return (before - after) / gap if gap > 0 else None


def _cache(config) -> int:
    return config.kv_cache_bytes_per_token(2)  # bf16


def write_report(run, summary: dict, after: dict, say) -> dict:
    evals = {w: json.loads(run.eval_file(w).read_text()) for w in ("teacher", "before")} | {"after": after}
    teacher_cfg, student_cfg = teacher_student_configs(json.loads((run.src / "config.json").read_text()), run.plan,
                                                       origin=str(run.src))
    share = recovered_share(*(evals[w]["val_loss"] for w in ("teacher", "before", "after")))
    report = {
        "src": str(run.src), "plan": run.plan, "out": str(run.out),
        "models": {w: {k: evals[w][k] for k in ("model", "class", "val_loss", "val_ppl")} for w in evals},
        "conversion_gap": evals["before"]["val_loss"] - evals["teacher"]["val_loss"],
        "recovered_share": share,
        "held_out": {k: evals["after"][k] for k in ("data", "seq_len", "tokens")},
        "kv_cache_bytes_per_token": {"teacher": _cache(teacher_cfg), "student": _cache(student_cfg)},
        "train": {k: summary.get(k) for k in ("steps", "tokens_seen", "tokens_per_s", "seed", "train_loss",
                                              "init_val_loss", "val_loss", "wall_time_s")},
        "distill": {k: getattr(run.cfg, f"distill_{k}") for k in ("alpha", "temperature", "hidden_weight")},
        "curve": summary.get("curve", []), "val_curve": summary.get("val_curve", []),
        "command": run.command,
    }
    png = _plot(report, run.out / "curves.png")
    report["plot"] = str(png) if png else None
    write_json_atomic(run.out / "report.json", report)
    write_text_atomic(run.out / "report.md", format_report(report))
    say(f"uptrain [5/5] report: {run.out / 'report.md'}")
    say(format_table(report))
    return report


def format_table(report: dict) -> str:
    cache = report["kv_cache_bytes_per_token"]
    rows = ["| model | held-out loss | perplexity | KV cache bytes/token (bf16) |", "|---|---|---|---|"]
    names = {"teacher": f"teacher ({report['models']['teacher']['class']})",
             "before": f"converted to {report['plan']}, before training",
             "after": f"after uptraining ({report['train']['steps']} steps)"}
    for w, name in names.items():
        m = report["models"][w]
        c = cache["teacher" if w == "teacher" else "student"]
        rows.append(f"| {name} | {m['val_loss']:.4f} | {m['val_ppl']:.2f} | {c:,} ({c / cache['teacher']:.2f}x) |")
    share = report["recovered_share"]
    rows.append("")
    rows.append(f"conversion gap {report['conversion_gap']:+.4f} nats; recovered share of the gap "
                + (f"{share:.1%}" if share is not None else "undefined (the conversion cost nothing)"))
    return "\n".join(rows)


def format_report(report: dict) -> str:
    h, t = report["held_out"], report["train"]
    d = report["distill"]
    return "\n".join([
        f"# uptrain: {report['src']} -> {report['plan']}", "",
        format_table(report), "",
        f"Held-out text: the validation split of `{h['data']}`, {h['tokens']:,} tokens in windows of {h['seq_len']} "
        "(the trainer's final evaluation windows). Recovered share = (before - after) / (before - teacher).", "",
        f"Training: {t['steps']} steps, {t['tokens_seen']:,} tokens, seed {t['seed']}, "
        f"{t['tokens_per_s'] or 0:,.0f} tokens/s; distillation alpha {d['alpha']:g}, temperature "
        f"{d['temperature']:g}, hidden-state weight {d['hidden_weight']:g} (fusedkv.train.distill).", "",
        "![curves](curves.png)", "",
        f"Command: `{report['command']}`", "",
    ])


def _plot(report: dict, path: Path) -> Path | None:
    curve = report["curve"]
    if not curve:
        return None
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    tokens = [r["tokens"] for r in curve]
    ema, smooth = None, []
    for r in curve:
        ema = r["loss"] if ema is None else 0.9 * ema + 0.1 * r["loss"]
        smooth.append(ema)
    # With distillation the training loss is the mixed objective, not the held-out cross-entropy's scale.
    what = "train loss" if report["distill"]["alpha"] == 0 else "train objective (alpha KL + (1 - alpha) CE)"
    ax.plot(tokens, [r["loss"] for r in curve], color="tab:blue", alpha=0.25, linewidth=0.8, label=what)
    ax.plot(tokens, smooth, color="tab:blue", linewidth=1.5, label=f"{what}, EMA 0.9")
    val = [(0, report["models"]["before"]["val_loss"])] + [(r["tokens"], r["val_loss"]) for r in report["val_curve"]]
    ax.plot(*zip(*val), "o-", color="tab:orange", markersize=4, label="held-out loss")
    for w, style in (("teacher", "k--"), ("before", "r:")):
        loss = report["models"][w]["val_loss"]
        ax.axhline(loss, linestyle=style[1:], color=style[0], linewidth=1, label=f"{w} ({loss:.3f})")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("nats/token")
    share = report["recovered_share"]
    ax.set_title(f"uptrain to {report['plan']}" + (f": {share:.0%} of the gap recovered" if share is not None
                                                  and math.isfinite(share) else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path
