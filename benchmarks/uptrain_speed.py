"""Uptraining throughput: the plain distillation step against each speed option, interleaved on one model.

    python benchmarks/uptrain_speed.py --src /work/realmodel/hf --converted CONVERTED --out DIR \
        [--rounds 3] [--steps 4] [--curve-steps 50]

CONVERTED is `fusedkv convert SRC CONVERTED --plan fusedkv`. Every variant is one `fusedkv.train.train`
run, as `fusedkv uptrain` starts it (its recipe: lr 1e-3, 10 warm-up steps; the teacher is SRC), for
`--steps` steps at `--seq-len` x `--batch`; the first step is warm-up, the others are timed. Round r runs
every variant once, in a rotated order, so that a loaded machine's slow minutes fall on all of them; the
table gives each round's tokens/s ratio to the plain run of the same round and the median. The teacher
store of the top-k variants is filled by an untimed run first (the cost every later seed and plan skips).
With --curve-steps N it then trains N steps plain, fast, and fast with another seed (the seed-to-seed noise),
and writes the three loss curves. Checkpoints are not written (the runs measure the step only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from fusedkv.train import TrainConfig, run_checkpoints, train

VARIANTS = {
    "plain": {},
    "freeze": {"freeze_lower_layers": True},
    "topk64": {"teacher_topk": 64},
    "freeze+topk64": {"freeze_lower_layers": True, "teacher_topk": 64},
    "freeze+topk64, 2 threads": {"freeze_lower_layers": True, "teacher_topk": 64, "threads": 2},
}


def _no_saving():
    """The runs measure the training step: no checkpoint, no final model (and no tied-weights save)."""
    run_checkpoints.RunCheckpoints.save = lambda self, *a, **k: None
    run_checkpoints.RunCheckpoints.save_final = lambda self: None


def config(args, out: Path, steps: int, seed: int = 0, **extra) -> TrainConfig:
    base = dict(preset="tiny", init_from=args.converted, distill_from=args.src, tokenizer=args.src, data=args.data,
                seq_len=args.seq_len, global_batch_tokens=args.seq_len * args.batch, micro_batch_size=args.batch,
                max_steps=steps, lr=1e-3, warmup_steps=10, eval_every=0, final_eval_batches=1, ckpt_every=0,
                out_dir=str(out), overwrite=True, progress=False, device="cpu", seed=seed, threads=1)
    return TrainConfig(**{**base, **extra})


def run(args, name: str, steps: int, seed: int = 0, **extra) -> dict:
    out = Path(args.out) / "runs" / name.replace(" ", "_").replace(",", "")
    t0 = time.time()
    result = train(config(args, out, steps, seed, **extra))
    curve = [(c["step"], c["loss"]) for c in result["curve"]]
    return {"name": name, "wall_s": time.time() - t0, "curve": curve, "result": result}


def tokens_per_s(args, res: dict) -> float:
    """Timed steps only (the first is warm-up): tokens over the sum of their step times."""
    import csv

    path = Path(res["result"]["out_dir"]) / "metrics.csv"
    rows = list(csv.DictReader(path.open()))[1:]
    return len(rows) * args.seq_len * args.batch / sum(args.seq_len * args.batch / float(r["tokens_per_s"])
                                                       for r in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", required=True)
    p.add_argument("--converted", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--data", default="builtin")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--variants", default=";".join(VARIANTS), help="names from VARIANTS, separated by ;")
    p.add_argument("--curve-steps", type=int, default=0)
    p.add_argument("--no-fill", action="store_true", help="the store already holds the timed windows")
    args = p.parse_args()
    _no_saving()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "speed.jsonl"
    names = args.variants.split(";")
    if args.rounds and not args.no_fill:
        t = time.time()
        run(args, "fill", args.steps, **{"teacher_topk": 64, "freeze_lower_layers": True})  # fills the store
        print(f"store filled for the timed windows in {time.time() - t:.0f} s", flush=True)
    table = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            res = run(args, n, args.steps, **VARIANTS[n])
            tps = tokens_per_s(args, res)
            table[n].append(tps)
            with log.open("a") as f:
                f.write(json.dumps({"round": r, "variant": n, "tokens_per_s": tps, "curve": res["curve"],
                                    "time": time.strftime("%H:%M:%S")}) + "\n")
            print(f"round {r} {n}: {tps:.1f} tokens/s  losses {[round(c[1], 3) for c in res['curve']]}", flush=True)
    print("| variant | tokens/s per round | ratio to plain per round | median ratio |")
    print("|---|---|---|---|")
    for n in names if args.rounds else ():
        ratios = [a / b for a, b in zip(table[n], table["plain"])]
        print(f"| {n} | {', '.join(f'{x:.1f}' for x in table[n])} | {', '.join(f'{x:.2f}x' for x in ratios)} | "
              f"{statistics.median(ratios):.2f}x |")
    if args.curve_steps:
        fast = {"freeze_lower_layers": True, "teacher_topk": 64}
        curves = {}
        for name, seed, extra in (("plain", 0, {}), ("fast", 0, fast), ("fast seed 1", 1, fast)):
            res = run(args, f"curve {name}", args.curve_steps, seed, **extra)
            curves[name] = {"curve": res["curve"], "tokens_per_s": tokens_per_s(args, res)}
            (out / "curves.json").write_text(json.dumps(curves, indent=1))
            print(f"curve {name}: {curves[name]['tokens_per_s']:.1f} tokens/s", flush=True)


if __name__ == "__main__":
    main()
