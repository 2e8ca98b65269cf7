"""An experiment's YAML file as the runner takes it: a shipped experiment by name or a file (`extends` resolved,
every run named and checked before any training), the fields merged base -> run -> overrides, and the runs a
`--runs` selection needs. Running it is `fusedkv.experiments.runner`.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from ..utils import slug

EXPERIMENTS_DIR = Path(__file__).parent


def load_experiment(name_or_path: str) -> dict:
    """A shipped experiment by name (`main`) or a YAML path; resolves `extends`."""
    path = Path(name_or_path)
    if not path.suffix:
        path = EXPERIMENTS_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        shipped = sorted(p.stem for p in EXPERIMENTS_DIR.glob("[!_]*.yaml"))
        raise ValueError(f"no experiment {name_or_path!r}; give a YAML file or one of {shipped}")
    spec = yaml.safe_load(path.read_text()) or {}
    if "extends" in spec:  # the parent's fields (runs, seeds, evaluate, ...) unless given; `base` merged
        parent = load_experiment(str(_parent_file(path, spec.pop("extends"))))
        if "runs" in spec and "paired" not in spec and "paired" in parent:
            # Other runs: the parent's pairs among them, or (none left) the default, every run vs the first.
            names = {run.get("name") for run in spec["runs"] or [] if isinstance(run, dict)}
            parent["paired"] = [pair for pair in parent.pop("paired") if set(pair) <= names] or None
        spec = {**parent, **spec, "base": merge_fields(parent.get("base", {}), spec.get("base", {}))}
    if "runs" in spec and not spec["runs"]:
        raise ValueError(f"{path}: 'runs' is empty; list at least one run")
    for i, run in enumerate(spec.get("runs", [])):
        if "name" not in run or "plan" not in run:
            raise ValueError(f"{path}: run {i + 1} needs a 'name' and a 'plan'")
    names = [run["name"] for run in spec.get("runs", [])]
    check_run_names(names, str(path))
    for pair in spec.get("paired") or []:  # checked now, not after hours of training
        if not (isinstance(pair, list) and len(pair) == 2 and all(n in names for n in pair)):
            raise ValueError(f"{path}: paired entry {pair!r} must be [RUN, REFERENCE], two of the run names {names}")
    return spec


def _parent_file(path: Path, extends) -> Path:
    """The file `extends: NAME` means in `path`: NAME(.yaml) beside it, else the shipped experiment NAME
    (so a user's file can extend `_small` or `main`)."""
    name = str(extends)
    file = name if name.endswith((".yaml", ".yml")) else f"{name}.yaml"
    for candidate in (path.parent / file, EXPERIMENTS_DIR / file):
        if candidate.is_file():
            return candidate
    shipped = sorted(p.stem for p in EXPERIMENTS_DIR.glob("*.yaml"))
    raise ValueError(f"{path}: extends: {name!r} is neither a file beside it ({path.parent / file}) nor a shipped "
                     f"experiment ({', '.join(shipped)})")


def check_run_names(names: list, origin: str) -> None:
    """Every run needs a name of its own: results, tables and run directories are keyed by it (two runs
    of one name would merge into one row, and "Lite" and "lite" would share a directory)."""
    seen: dict[str, str] = {}
    for name in names:
        other = seen.get(run_slug(str(name)))
        if other is not None:
            same = ("twice" if other == name
                    else f"as {name!r} and {other!r}, which share the directory {run_slug(name)!r}")
            raise ValueError(f"{origin}: run name {other!r} is used {same}; give every run its own name")
        seen[run_slug(str(name))] = name


def merge_fields(a: dict, b: dict) -> dict:
    """`a` with `b`'s fields over it, nested dicts merged field by field (an experiment's base, a run's own
    fields, the command line's overrides)."""
    out = dict(a)
    for k, v in b.items():
        out[k] = merge_fields(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def run_slug(name: str) -> str:
    """The directory name of a run (case-folded: "Lite" and "lite" are one directory)."""
    return slug(name).lower()


def selected_runs(runs: list[dict], only: list[str] | None) -> list[dict]:
    """The runs named in `only` and, transitively, the runs they start from, in the file's order."""
    if not only:
        return runs
    by_name = {run["name"]: run for run in runs}
    unknown = [name for name in only if name not in by_name]
    if unknown:
        raise ValueError(f"--runs: no run named {', '.join(map(repr, unknown))} in the experiment; its runs: "
                         f"{', '.join(by_name)}")
    wanted, todo = set(), list(only)
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted.add(name)
            todo += [by_name[name][k] for k in ("from", "distill") if k in by_name[name]]
    return [run for run in runs if run["name"] in wanted]
