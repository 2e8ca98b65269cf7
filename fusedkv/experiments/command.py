"""`fusedkv compare`: train and evaluate a set of plans under one budget and write the table."""

from __future__ import annotations

from pathlib import Path

from .. import argtypes
from ..errors import UsageError
from ..utils import write_text_atomic


def register(sub) -> None:
    p = sub.add_parser(
        "compare", help="train and evaluate several plans under one budget (the paper's tables)",
        description="Run an experiment file: every run trains on the same data with the same token budget, "
        "optimiser and seeds, then is evaluated (held-out loss and perplexity, local lm-eval tasks). Writes "
        "results.md (mean ± std over seeds) and curves.png. Shipped experiments: main (Table 2), sources "
        "(Table 17), reversed (Fig. 8), init (Table 5), dense (Fig. 2); the compatibility pairs of App. A.6: "
        "gqa, swa (window hybrids +W/+WF), moe, mla, quant (checkpoints for KIVI/Wanda); and the evidence runs: "
        "retrieval (Table 16 at toy scale), passkey (its needle tasks), long (Table 2 at 10x tokens), uptrain "
        "(convert + distil). Finished runs are reused and a run killed part-way continues from its last "
        "checkpoint, so an interrupted comparison resumes. To use several cores, start the same command once per "
        "core (one thread per run: `threads: 1`): each trains the next run no other process is training.")
    p.add_argument("experiment", nargs="?", default="main", type=argtypes.non_empty,
                   help="shipped experiment name (main, gqa, swa, moe, mla, quant, long, ...) or YAML path")
    p.add_argument("--out", default=None, type=argtypes.output_dir,
                   help="output directory (default runs/compare-<name>)")
    p.add_argument("--seeds", default=None, type=argtypes.int_list(0, 2**32 - 1),
                   help="comma-separated seeds (default: the file's)")
    p.add_argument("--preset", default=None,
                   help="replace the file's small base with a training preset (e.g. 332m on a GPU)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a training field for every run, e.g. --set max_steps=50 (repeatable)")
    p.add_argument("--runs", default=None, type=argtypes.name_list(), metavar="NAME[,NAME...]",
                   help="only these runs of the file (and the runs they start from); the tables cover them alone")
    p.add_argument("--finished-only", action="store_true",
                   help="train nothing: write the tables from the runs already finished and list the others")
    p.add_argument("--record", default=None, type=argtypes.non_empty, metavar="FILE",
                   help="a committed record of finished runs (JSON, e.g. docs/compare/retrieval_format2.json): a "
                   "row whose cache key is a run's counts as that run finished, so the tables can be written on "
                   "a machine without runs/")
    p.add_argument("--task-limit", type=argtypes.non_negative_int, default=40,
                   help="items per local lm-eval task (0: skip tasks; default 40)")
    p.add_argument("--source", default=None, type=argtypes.non_empty, metavar="PATH",
                   help="experiments on a pretrained model (smollm2): the model, a checkpoint directory or a GGUF "
                   "file (default: the file's `source:`)")
    p.set_defaults(func=run)


def run(args) -> None:
    from ..train.config import parse_overrides
    from .record import load as load_record
    from .report import paired_table, plot_curves, retrieval_report, summary_table
    from .runner import run_experiment
    from .spec import load_experiment
    from .verdicts import check_claims, experiment_claims, verdict_table

    _check_experiment_file(args.experiment)
    spec = load_experiment(args.experiment)
    if "source" in spec:  # a pretrained model's cache options: no training runner, no seeds
        return _run_pretrained(spec, args)
    check_claims(spec)
    overrides = parse_overrides(args.overrides)
    seeds = args.seeds
    name = spec.get("name", Path(args.experiment).stem)
    out = Path(args.out or f"runs/compare-{name}")
    recorded = load_record(args.record) if args.record else None
    results = run_experiment(spec, out, seeds, args.preset, overrides, args.task_limit,
                             finished_only=args.finished_only, only=args.runs, record=recorded)
    if not results:
        raise UsageError(f"no run of {name!r} has finished yet; run it without --finished-only")
    table = summary_table(results)
    paired = paired_table(results, spec.get("paired"))
    if paired:
        table += "\n\nPaired differences, seed by seed (t on seeds - 1 degrees of freedom):\n\n" + paired
    claims = experiment_claims(spec, results)  # the file's `claims:`, judged by one rule (docs/evidence.md)
    if claims:
        table += "\n\nVerdicts on the paper's claims:\n\n" + verdict_table(claims)
    plot_curves(results, out / "curves.png", spec.get("description", name))
    write_text_atomic(out / "results.md", f"# {spec.get('description', name)}\n\n{table}\n\n![curves](curves.png)\n")
    print(table)
    print(f"\nwrote {out / 'results.md'} and {out / 'curves.png'}")
    # experiments with `evaluate: retrieval`
    report = retrieval_report(results, out, spec.get("description", name), spec.get("paired"))
    if report:
        print(Path(report).read_text())
        print(f"wrote {report} and {out / 'retrieval.png'}")


def _run_pretrained(spec: dict, args) -> None:
    from . import pretrained, pretrained_report

    name = spec.get("name", Path(args.experiment).stem)
    out = Path(args.out or f"runs/compare-{name}")
    results = pretrained.run(spec, out, args.source, args.runs, args.finished_only,
                              task_limit=args.task_limit)
    if not results:
        raise UsageError(f"no row of {name!r} has finished yet; run it without --finished-only")
    print(pretrained_report.write_outputs(spec, results, out))
    print(f"\nwrote {out / 'results.md'}, {out / 'results.json'} and {out / 'quality_vs_bytes.png'}")


def _check_experiment_file(name_or_path: str) -> None:
    """A YAML path is read and parsed here first, so a binary, malformed or non-mapping file is reported
    in one line naming it (a shipped name is checked by `load_experiment`)."""
    import yaml

    path = Path(name_or_path)
    if not path.suffix:
        return
    if path.is_dir():
        raise UsageError(f"{path} is a directory; give an experiment YAML file")
    if not path.exists():
        raise UsageError(f"{path}: no such experiment file")
    try:
        spec = yaml.safe_load(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UsageError(f"{path} is not a UTF-8 YAML file ({e.reason} at byte {e.start})") from None
    except yaml.YAMLError as e:
        raise UsageError(f"{path} is not valid YAML: {' '.join(str(e).split())}") from None
    if spec is not None and not isinstance(spec, dict):
        raise UsageError(f"{path}: an experiment file is a mapping (name, base, runs, seeds), got a "
                         f"{type(spec).__name__}")
    runs = (spec or {}).get("runs", [])
    if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
        raise UsageError(f"{path}: 'runs' must be a list of mappings, each with a name and a plan")
