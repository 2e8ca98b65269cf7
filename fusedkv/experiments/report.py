"""The summary of a comparison (`fusedkv compare`): the Table-2-style table (mean ± std over seeds), the
paired differences between runs seed by seed with their t statistics, the learning curves, and the
retrieval report. Pure functions of the runs' results (`runner.run_experiment`)."""

from __future__ import annotations

import math
import statistics
import textwrap
from pathlib import Path

from ..eval.retrieval import mqar_score
from ..utils import save_figure, write_text_atomic


def retrieval_report(results: list[dict], out_dir, title: str, pairs: list | None = None) -> str | None:
    """retrieval.md and retrieval.png; None when no run has scores. The report opens with each run's MQAR
    score (accuracy averaged over the pair counts) per length, mean ± std over seeds, and the paired
    differences of that score (`pairs`, as for `paired_table`); then one table per run, mean over seeds."""
    from ..eval.retrieval import format_retrieval, plot_retrieval
    from .verdicts import retrieval_floors

    per_run: dict[str, dict] = {}
    for name in dict.fromkeys(r["name"] for r in results):
        scored = [r["retrieval"] for r in results if r["name"] == name and r.get("retrieval")]
        if not scored:
            continue
        # One seed: its own table, significance marks included. A mean over seeds is no binomial sample (the
        # seeds answer the same questions): no marks, `seeds` says how many; who learned is listed per seed.
        mean = {"lengths": scored[0]["lengths"], "pairs": scored[0]["pairs"], "mqar": {}, "passkey": {},
                "num_samples": scored[0].get("num_samples", 0) if len(scored) == 1 else 0, "seeds": len(scored)}
        for p in mean["pairs"]:
            mean["mqar"][p] = {L: _mean_cell([s["mqar"][_k(s["mqar"], p)] for s in scored], L)
                               for L in mean["lengths"]}
        mean["passkey"] = {L: _mean_cell([s["passkey"] for s in scored], L) for L in mean["lengths"]}
        per_run[name] = mean
    if not per_run:
        return None
    out_dir = Path(out_dir)
    seeds = len({r["seed"] for r in results})
    text = f"# {title}: retrieval accuracy (%), {seeds} seed(s)\n\n"
    text += "## MQAR score: accuracy averaged over the pair counts, mean ± std over seeds\n\n"
    text += _mqar_score_table(results)
    if seeds > 1:
        text += ("\n\nPer seed (`†`: the lookup is learned at that length, every pair count significantly above its "
                 "random-copy floor):\n\n" + _mqar_seed_table(results))
    text += "\n\n" + retrieval_floors(results)  # the floors beside the scores, and who learned the lookup
    paired = _mqar_paired_table(results, pairs)
    if paired:
        text += ("\n\nPaired differences of the MQAR score, seed by seed, at the longest length both runs "
                 "were scored at (t on seeds - 1 degrees of freedom):\n\n" + paired)
    text += "\n\n" + "\n\n".join(f"## {name} (mean over seeds)\n\n{format_retrieval(r)}"
                                   for name, r in per_run.items())
    write_text_atomic(out_dir / "retrieval.md", text + "\n\n![retrieval](retrieval.png)\n")
    plot_retrieval(per_run, out_dir / "retrieval.png", title)
    return str(out_dir / "retrieval.md")


def _scores(results: list[dict]) -> dict[tuple[str, int], dict[int, float]]:
    """(run name, seed) -> {length: MQAR score} for every scored result."""
    return {(r["name"], r["seed"]): {int(L): v for L in r["retrieval"]["lengths"]
                                     if (v := mqar_score(r["retrieval"], L)) is not None}
            for r in results if r.get("retrieval")}


def _mqar_score_table(results: list[dict]) -> str:
    scores = _scores(results)
    lengths = sorted({L for row in scores.values() for L in row})
    lines = ["| run | seeds | " + " | ".join(str(L) for L in lengths) + " |", "|---|---|" + "---:|" * len(lengths)]
    for name in dict.fromkeys(n for n, _ in scores):
        rows = [row for (n, _), row in scores.items() if n == name]
        cells = [_mean_std([row[L] for row in rows if L in row], digits=1) or "-" for L in lengths]
        lines.append(f"| {name} | {len(rows)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mqar_seed_table(results: list[dict]) -> str:
    from ..eval.retrieval import learned

    scores = _scores(results)
    lengths = sorted({L for row in scores.values() for L in row})
    lines = ["| run | seed | valid loss | " + " | ".join(str(L) for L in lengths) + " |",
             "|---|---|---|" + "---:|" * len(lengths)]
    for r in results:
        if r.get("retrieval"):
            row = scores[r["name"], r["seed"]]
            cells = [f"{row[L]:.1f}" + ("†" if learned(r["retrieval"], L) else "") if L in row else "-"
                     for L in lengths]
            lines.append(f"| {r['name']} | {r['seed']} | {r['val_loss']:.4f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mqar_paired_table(results: list[dict], pairs: list | None) -> str:
    scores = _scores(results)
    names = list(dict.fromkeys(n for n, _ in scores))
    lines = []
    for run, ref in pairs if pairs is not None else [[n, names[0]] for n in names[1:]]:
        seeds = sorted(s for (n, s) in scores if n == run and (ref, s) in scores)
        common = [set(scores[run, s]) & set(scores[ref, s]) for s in seeds]
        if len(seeds) < 2 or not all(common):
            continue
        length = max(set.intersection(*common))
        d = [scores[run, s][length] - scores[ref, s][length] for s in seeds]
        lines.append(_paired_row(f"{run} − {ref} @ {length}", d, digits=1))
    if not lines:
        return ""
    return _PAIRED_HEAD.format(what="MQAR score, points") + "\n" + "\n".join(lines)


def _k(d: dict, key):
    """A key as stored: int in memory, str once a result went through JSON."""
    return key if key in d else str(key)


def _mean_cell(rows: list[dict], length: int) -> float | None:
    vals = [row.get(_k(row, length)) for row in rows]
    vals = [v for v in vals if v is not None]
    return statistics.mean(vals) if vals else None


def _mean_std(xs: list[float], digits: int = 4) -> str:
    """"mean ± std" of `xs` ("" when empty, the value alone when there is one)."""
    if len(xs) <= 1:
        return f"{xs[0]:.{digits}f}" if xs else ""
    return f"{statistics.mean(xs):.{digits}f} ± {statistics.stdev(xs):.{digits}f}"


def summary_table(results: list[dict]) -> str:
    names = list(dict.fromkeys(r["name"] for r in results))
    tasks = sorted({t for r in results for t in r.get("tasks", {})})
    head = "| run | plan | cache | seeds | valid loss | perplexity | " + " | ".join(tasks) + (" |" if tasks else "")
    if tasks:
        head += " task avg |"
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for name in names:
        rs = [r for r in results if r["name"] == name]
        row = (f"| {name} | {rs[0]['plan']} | {rs[0]['cache']:.2g} | {len(rs)} | "
               f"{_mean_std([r['val_loss'] for r in rs])} | {_mean_std([r['val_ppl'] for r in rs])} |")
        if tasks:
            per_task = [statistics.mean(r["tasks"][t] for r in rs) * 100 for t in tasks]
            row += "".join(f" {v:.1f} |" for v in per_task) + f" {statistics.mean(per_task):.1f} |"
        lines.append(row)
    return "\n".join(lines)


# Two-sided 5% critical values of Student's t for 1-30 degrees of freedom (the "p < 0.05" column); past
# 30 the value at 30 is used, which is conservative.
_T_CRIT_05 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
              2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
              2.045, 2.042)


def paired_table(results: list[dict], pairs: list | None = None) -> str:
    """Paired differences of validation loss, `run - reference` seed by seed: mean ± std, the per-seed
    values, t = mean / (std / sqrt(n)) and whether |t| clears the two-sided 5% level. `pairs` defaults to
    every run against the first; "" when fewer than two seeds are shared."""
    names = list(dict.fromkeys(r["name"] for r in results))
    loss = {(r["name"], r["seed"]): r["val_loss"] for r in results}
    pairs = pairs if pairs is not None else [[n, names[0]] for n in names[1:]]
    lines = []
    for run, ref in pairs:  # names checked by load_experiment
        seeds = sorted(s for (n, s) in loss if n == run and (ref, s) in loss)
        if len(seeds) >= 2:
            lines.append(_paired_row(f"{run} − {ref}", [loss[run, s] - loss[ref, s] for s in seeds], digits=4))
    if not lines:
        return ""
    return _PAIRED_HEAD.format(what="valid loss") + "\n" + "\n".join(lines)


_PAIRED_HEAD = "| difference ({what}) | seeds | mean ± std | per seed | t | p < 0.05 |\n|---|---|---|---|---|---|"


def _paired_row(label: str, d: list[float], digits: int) -> str:
    """One row of a paired table: the differences `d` (two or more seeds), their t and its verdict."""
    mean, sd = statistics.mean(d), statistics.stdev(d)
    t = mean / (sd / math.sqrt(len(d))) if sd > 0 else math.copysign(math.inf, mean)
    crit = _T_CRIT_05[min(len(d) - 1, len(_T_CRIT_05)) - 1]
    return (f"| {label} | {len(d)} | {mean:+.{digits}f} ± {sd:.{digits}f} | "
            f"{', '.join(f'{x:+.{digits}f}' for x in d)} | {t:+.1f} | {'yes' if abs(t) > crit else 'no'} |")


def plot_curves(results: list[dict], path, title: str) -> None:
    """Validation loss against tokens, mean over seeds with a min-max band, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    unrecorded = []  # runs known only from a record made before records kept curves
    for name in dict.fromkeys(r["name"] for r in results):
        curves = [dict(r["curve"]) for r in results if r["name"] == name and r.get("curve")]
        if not curves:
            unrecorded.append(name)
            continue
        xs = sorted(set.intersection(*(set(c) for c in curves)))
        ys = [[c[x] for c in curves] for x in xs]
        mean = [statistics.mean(y) for y in ys]
        line, = ax.plot(xs, mean, label=name)
        if len(curves) > 1:
            ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], color=line.get_color(), alpha=0.15)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation loss")
    ax.set_title(textwrap.fill(title, 70), fontsize=10)
    ax.grid(alpha=0.3)
    if unrecorded:
        ax.text(0.01, 0.01, "no curve recorded: " + ", ".join(unrecorded), transform=ax.transAxes, fontsize=7)
    if len(unrecorded) < len(dict.fromkeys(r["name"] for r in results)):
        ax.legend(fontsize=8)
    tails = [v for r in results for _, v in (r.get("curve") or [])[len(r.get("curve") or []) // 3:]]
    lo = min(tails, default=None)
    if lo is not None:  # zoom on the part of the curves where plans differ
        hi = max(tails)
        ax.set_ylim(lo - 0.05 * (hi - lo + 1e-9), hi + 0.05 * (hi - lo + 1e-9))
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
