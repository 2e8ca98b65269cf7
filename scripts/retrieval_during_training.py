"""When does retrieval emerge? Score every checkpoint of one or more training runs on MQAR, as they appear.

A training run keeps only its newest checkpoints, so this watches the runs while they train: every new
`checkpoints/step-N` (verified and loaded by `fusedkv.train.full_checkpoint.load_checkpoint`, so a checkpoint
still being written is left for the next poll) and `final/` at the end are scored by
`fusedkv.eval.retrieval` (MQAR, the same samples at every step), one JSON line per (run, step) appended to
--out. Then --plot draws accuracy against training step, one line per run, one panel per number of pairs.

    python scripts/retrieval_during_training.py --tokenizer runs/data/DATASET/tokenizer \
        --runs vanilla=runs/compare-cache/KEY1/train fusedkv=runs/compare-cache/KEY2/train \
        --out runs/retrieval-steps.jsonl --watch --plot docs/compare/retrieval_steps.png

--watch polls until every run has written `final/`; without it, what exists now is scored once. Lines
already in --out are not scored again, so the command can be stopped and re-run. --summarise reads such
files (one per seed) and prints the step at which each run learned the lookup in each (every pair count
at the shortest length significantly above its random-copy floor; `--threshold` for a mean accuracy):

    python scripts/retrieval_during_training.py --summarise runs/retrieval-steps/s{0,1,2}.jsonl \
        --plot docs/compare/retrieval_steps.png
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from fusedkv import FusedKVConfig, FusedKVForCausalLM
from fusedkv.data import load_tokenizer
from fusedkv.eval.retrieval import learned, run_retrieval
from fusedkv.train.full_checkpoint import load_checkpoint


def load_step(path: Path) -> FusedKVForCausalLM:
    """A training checkpoint (`checkpoints/step-N`) or a saved model directory (`final/`)."""
    if (path / "config.json").is_file():
        return FusedKVForCausalLM.from_pretrained(path).eval()
    ckpt = load_checkpoint(path)
    model = FusedKVForCausalLM(FusedKVConfig.from_dict(ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    return model.eval()


def steps_of(train_dir: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every checkpoint there now, and of `final/` once the run has finished (its
    summary.json, written after final/, gives the step)."""
    found = [(int(p.name.split("-")[1]), p) for p in (train_dir / "checkpoints").glob("step-*")]
    if (train_dir / "summary.json").is_file() and (train_dir / "final" / "config.json").is_file():
        found.append((int(json.loads((train_dir / "summary.json").read_text())["steps"]), train_dir / "final"))
    return sorted(found)


def score(args) -> None:
    runs = dict(item.split("=", 1) for item in args.runs)
    out = Path(args.out)
    done = set()
    if out.is_file():
        done = {(r["run"], r["step"]) for r in map(json.loads, out.read_text().splitlines())}
    tokenizer = load_tokenizer(args.tokenizer)
    lengths = [int(x) for x in args.lengths.split(",")]
    pairs = [int(x) for x in args.pairs.split(",")]
    while True:
        for name, train_dir in runs.items():
            for step, path in steps_of(Path(train_dir)):
                if (name, step) in done:
                    continue
                try:
                    model = load_step(path)
                except (OSError, ValueError):  # still being written, or replaced by a newer one: next poll
                    continue
                with torch.no_grad():
                    r = run_retrieval(model, tokenizer, lengths, pairs, args.samples)
                row = {"run": name, "step": step, "samples": args.samples, "mqar": r["mqar"],
                       "passkey": r["passkey"]}
                with out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                done.add((name, step))
                print(name, step, {p: r["mqar"][p] for p in pairs}, flush=True)
        finished = all((Path(d) / "summary.json").is_file() for d in runs.values())
        if not args.watch or finished:
            return
        time.sleep(args.poll)


def emergence(rows: list[dict], threshold: float | None = None, samples: int = 30) -> dict[str, str]:
    """Per run, when retrieval emerged: the first scored step at which the model has learned the lookup,
    i.e. every pair count at the shortest length is significantly above its random-copy floor
    (`fusedkv.eval.retrieval.learned`; a row's own "samples", else `samples`), or, with `threshold`, at
    which the accuracy averaged over the pair counts reaches it (%; the rule of the MQAR format-1 files,
    whose 50% lay below that format's elimination floor). "≤ S" when S, the first step scored, already
    does (it emerged before it was watched), "> S" when no step up to S, the last, does."""
    out = {}
    for name in dict.fromkeys(r["run"] for r in rows):
        if threshold is None:
            pts = sorted((r["step"], _learned(r, samples)) for r in rows if r["run"] == name)
            hit = next((step for step, ok in pts if ok), None)
        else:
            pts = sorted((r["step"], _mean_at_shortest(r)) for r in rows if r["run"] == name)
            hit = next((step for step, acc in pts if acc >= threshold), None)
        out[name] = f"> {pts[-1][0]}" if hit is None else f"≤ {hit}" if hit == pts[0][0] else str(hit)
    return out


def _learned(row: dict, samples: int) -> bool:
    lengths = sorted({int(L) for per_length in row["mqar"].values() for L in per_length})
    return learned({"lengths": lengths, "mqar": row["mqar"], "num_samples": row.get("samples", samples)})


def _mean_at_shortest(row: dict) -> float:
    length = min(int(L) for per_length in row["mqar"].values() for L in per_length)
    vals = [per_length[str(length)] for per_length in row["mqar"].values() if str(length) in per_length]
    return sum(vals) / len(vals)


def summarise(files: list[str], threshold: float | None = None, samples: int = 30) -> str:
    """Markdown: one row per run, one column per JSON-lines file (a seed each), the step it emerged at."""
    per_file = [emergence(_read(f), threshold, samples) for f in files]
    names = list(dict.fromkeys(n for e in per_file for n in e))
    lines = ["| run | " + " | ".join(Path(f).stem for f in files) + " |", "|---|" + "---|" * len(files)]
    lines += [f"| {n} | " + " | ".join(e.get(n, "-") for e in per_file) + " |" for n in names]
    return "\n".join(lines)


def _read(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot(files: list[str], path: str) -> None:
    """Accuracy against training step, one panel per number of pairs, one colour per run and one line per
    file (seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_file = [_read(f) for f in files]
    rows = [r for rs in per_file for r in rs]
    pairs = sorted({int(p) for r in rows for p in r["mqar"]})
    length = min(int(L) for r in rows for L in next(iter(r["mqar"].values())))
    colours = {name: f"C{i}" for i, name in enumerate(dict.fromkeys(r["run"] for r in rows))}
    fig, axes = plt.subplots(1, len(pairs), figsize=(4 * len(pairs), 3.6), sharey=True, squeeze=False)
    for ax, p in zip(axes[0], pairs):
        for i, rs in enumerate(per_file):
            for name in dict.fromkeys(r["run"] for r in rs):
                pts = sorted((r["step"], r["mqar"][str(p)][str(length)]) for r in rs if r["run"] == name)
                ax.plot([s for s, _ in pts], [a for _, a in pts], marker="o", ms=3, color=colours[name],
                        alpha=1.0 if len(files) == 1 else 0.6, label=name if i == 0 else None)
        ax.set_title(f"MQAR, {p} pairs, {length} tokens", fontsize=10)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy (%)")
    axes[0][0].legend(fontsize=8)
    if len(files) > 1:
        fig.suptitle(f"one line per seed ({', '.join(Path(f).stem for f in files)})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", metavar="NAME=TRAIN_DIR", help="score these runs' checkpoints")
    p.add_argument("--tokenizer", help="the runs' tokenizer (runs/data/DATASET/tokenizer)")
    p.add_argument("--out", help="JSON lines, appended")
    p.add_argument("--lengths", default="64")
    p.add_argument("--pairs", default="2,4,8")
    p.add_argument("--samples", type=int, default=30)
    p.add_argument("--watch", action="store_true")
    p.add_argument("--poll", type=float, default=30.0)
    p.add_argument("--plot", help="PNG of accuracy against step (of --out, or of the --summarise files)")
    p.add_argument("--summarise", nargs="+", metavar="JSONL",
                   help="score nothing: print the step at which each run's retrieval emerged in each file")
    p.add_argument("--threshold", type=float, default=None,
                   help="emerged: mean accuracy over the pair counts at the shortest length reaches this (%%); "
                   "default: every pair count there significantly above its random-copy floor")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    if args.summarise:
        print(summarise(args.summarise, args.threshold, args.samples))
        if args.plot:
            plot(args.summarise, args.plot)
        return
    if not (args.runs and args.tokenizer and args.out):
        p.error("scoring needs --runs, --tokenizer and --out (or give --summarise FILES)")
    torch.set_num_threads(args.threads)
    score(args)
    if args.plot:
        plot([args.out], args.plot)


if __name__ == "__main__":
    main()
