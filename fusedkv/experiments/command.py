"""`fusedkv compare`: train and evaluate a set of plans under one budget and write the table."""

from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser(
        "compare", help="train and evaluate several plans under one budget (the paper's tables)",
        description="Run an experiment file: every run trains on the same data with the same token budget, "
        "optimiser and seeds, then is evaluated (held-out loss and perplexity, local lm-eval tasks). Writes "
        "results.md (mean ± std over seeds) and curves.png. Shipped experiments: main (Table 2), sources "
        "(Table 17), reversed (Fig. 8), init (Table 5), dense (Fig. 2). Finished runs are reused, so an "
        "interrupted comparison resumes.")
    p.add_argument("experiment", nargs="?", default="main", help="shipped experiment name or YAML path")
    p.add_argument("--out", default=None, help="output directory (default runs/compare-<name>)")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default: the file's)")
    p.add_argument("--preset", default=None,
                   help="replace the file's small base with a training preset (e.g. 332m on a GPU)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a training field for every run, e.g. --set max_steps=50 (repeatable)")
    p.add_argument("--task-limit", type=int, default=40, help="items per local lm-eval task (0: skip tasks)")
    p.set_defaults(func=run)


def run(args) -> None:
    import yaml

    from .runner import load_experiment, plot_curves, run_experiment, summary_table

    spec = load_experiment(args.experiment)
    overrides: dict = {}
    for item in args.overrides:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        key, value = item.split("=", 1)
        node = overrides
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
    name = spec.get("name", Path(args.experiment).stem)
    out = Path(args.out or f"runs/compare-{name}")
    results = run_experiment(spec, out, seeds, args.preset, overrides, args.task_limit)
    table = summary_table(results)
    plot_curves(results, out / "curves.png", spec.get("description", name))
    (out / "results.md").write_text(f"# {spec.get('description', name)}\n\n{table}\n\n![curves](curves.png)\n")
    print(table)
    print(f"\nwrote {out / 'results.md'} and {out / 'curves.png'}")
