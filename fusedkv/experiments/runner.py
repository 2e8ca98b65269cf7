"""Run an experiment: train and evaluate several plans under one budget, over several seeds.

An experiment is a YAML file (the shipped ones sit beside this module: main, sources, reversed, init,
dense): a shared `base` training config (or `extends: FILE` to share one), a list of `runs` (a name,
a plan, model overrides such as a custom source map) and `seeds`. Every run trains with the same data,
token budget, optimiser and seeds; only the plan differs. Results are written per run as they finish
(`RUN/seedN/result.json`), so an interrupted comparison resumes where it stopped: finished runs are
reused, and a run killed part-way continues from its newest checkpoint (`ckpt_every`). The summary is a
Table-2-style markdown table (mean +- std over seeds) and a learning-curve PNG (`report`).

Chained runs (uptraining, continued training at a longer context): a run with `from: NAME` starts from
the final model of the earlier run NAME (same seed); when its `plan` differs, that model is first
converted to the plan (`fusedkv.convert`: upper K/V projections dropped). `distill: NAME` adds
distillation from NAME's final model (`fusedkv.train.distill`). A chained run's learning curve is
shifted by the tokens its ancestors trained on, so curves compare at equal total tokens. A top-level
`evaluate: {retrieval: {lengths, pairs, samples}}` scores every run on the synthetic retrieval tasks
(`fusedkv.eval.retrieval`) at the lengths that fit its context.

With two or more seeds the summary adds paired differences of validation loss (seed by seed, so the
seed's shared data order and initialisation cancel): every run against the first by default, or the
pairs listed under `paired: [[RUN, REFERENCE], ...]`, each with its t statistic on n - 1 degrees of
freedom.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import socket
import time
from pathlib import Path

from ..data.synthetic import versioned_spec
from ..errors import Stopped, UsageError
from ..plan import resolve_plan_choice
from ..utils import write_json_atomic
from .spec import check_run_names, merge_fields, run_slug, selected_runs


def run_experiment(spec: dict, out_dir, seeds: list[int] | None = None, preset: str | None = None,
                   overrides: dict | None = None, task_limit: int | None = 40, progress: bool = True,
                   cache_dir=None, finished_only: bool = False, only: list[str] | None = None,
                   record: dict[str, dict] | None = None) -> list[dict]:
    """Train and evaluate every (run, seed); returns one result dict per pair, in the file's order.
    `finished_only`: train nothing, return the pairs already finished (a chained run counts only when its
    ancestors do). `only`: these runs and the runs they start from (`from:` / `distill:`), not the others.
    `record`: rows of a committed record by cache key (`record.load`): a row whose key is a run's counts
    as that run finished.

    Finished runs are kept twice: under `out_dir/RUN/seedN/result.json` (this experiment's record) and
    in a cache keyed by the complete training configuration (`cache_dir`, default
    `$FUSEDKV_COMPARE_CACHE` or `runs/compare-cache`). Experiments that share a configuration (the
    ablations' Lite and FusedKV rows are the main table's) therefore train it once.

    Several processes may run the same comparison at once (one per core): a run being trained holds a lock
    in its cache directory, and the others take the next free run and come back to the locked one (or to a
    chained run whose ancestor is locked) when it is free, reusing its result.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cache_dir = Path(cache_dir or os.environ.get("FUSEDKV_COMPARE_CACHE", "runs/compare-cache"))
    base = {"preset": preset} if preset else dict(spec.get("base", {}))
    overrides = overrides or {}  # --set: over the base and over each run's own values ("for every run")
    seeds = seeds if seeds is not None else list(spec.get("seeds", [0]))
    evaluate = spec.get("evaluate") or {}
    check_run_names([run["name"] for run in spec["runs"]], "the experiment")
    listed = set()
    for run in spec["runs"]:
        for what in ("from", "distill"):
            if what in run and run[what] not in listed:
                raise ValueError(f"run {run['name']!r}: {what}: {run[what]!r} must name a run listed before it")
        listed.add(run["name"])
    runs = selected_runs(spec["runs"], only)
    # Every (run, seed)'s settings are resolved and keyed before anything trains, so a bad one is reported
    # at once; the key is the complete resolved TrainConfig (preset values filled in) plus the ancestors'
    # keys and the evaluation, so any change to what a run computes makes it another run.
    keys: dict[tuple[str, int], str] = {}
    for run in runs:
        for seed in seeds:
            own = {k: v for k, v in run.items() if k not in _CHAIN_KEYS}
            fields = {**merge_fields(merge_fields(base, own), overrides), "seed": seed}
            # A chained run is another run whenever an ancestor is: its key includes theirs.
            identity = {**_resolved(fields, run["name"]), **{k: keys[run[k], seed] for k in ("from", "distill")
                                                               if k in run},
                        **({"evaluate": evaluate} if evaluate else {})}
            keys[run["name"], seed] = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str)
                                                     .encode()).hexdigest()[:16]
    finished: dict[tuple[str, int], tuple[str, dict]] = {}  # (run name, seed) -> (cache key, result)
    jobs = [(run, seed) for run in runs for seed in seeds]
    count = {"started": 0, "total": len(jobs)}
    waiting: set = set()  # jobs reported as waiting for another process (said once each)
    while jobs:
        # One pass in the file's order; a job held by another process (or whose ancestor is) waits for the
        # next pass. Ancestors come first in the file, so a pass that finishes nothing is all waiting.
        deferred = []
        for run, seed in jobs:
            ancestors = [(run[k], seed) for k in ("from", "distill") if k in run]
            if any(a not in finished for a in ancestors):
                if finished_only:  # an ancestor has not finished, so neither has this run
                    if progress:
                        print(f"not finished: {run['name']} seed {seed}", flush=True)
                    continue
                deferred.append((run, seed))
                continue
            parents = {k: finished[run[k], seed] for k in ("from", "distill") if k in run}
            result = _run_one(run, seed, keys[run["name"], seed], parents, base, overrides, evaluate, out_dir,
                              cache_dir, task_limit, finished_only, progress, count, record or {})
            if result is _HELD:
                if progress and (run["name"], seed) not in waiting:
                    print(f"  {run['name']} seed {seed} is being trained by another process; coming back to it",
                          flush=True)
                    waiting.add((run["name"], seed))
                deferred.append((run, seed))
            elif result is not None:
                finished[run["name"], seed] = (keys[run["name"], seed], result)
        if len(deferred) == len(jobs):  # nothing could move: wait for the other process
            time.sleep(LOCK_POLL_S)
        jobs = deferred
    order = {(run["name"], seed): i for i, (run, seed) in enumerate((r, s) for r in runs for s in seeds)}
    return [result for _, (_, result) in sorted(finished.items(), key=lambda item: order[item[0]])]


_HELD = object()  # _run_one's answer for a run another process is training
LOCK_POLL_S = 10.0  # how often a process that can do nothing else looks at the other process's lock again


def _run_one(run: dict, seed: int, key: str, parents: dict, base: dict, overrides: dict, evaluate: dict,
             out_dir: Path, cache_dir: Path, task_limit, finished_only: bool, progress: bool, count: dict,
             record: dict[str, dict]):
    """One (run, seed): its cached or recorded result, else trained and evaluated now. None when
    `finished_only` and it has not finished; `_HELD` when another process holds its lock."""
    from ..train import TrainConfig, train

    run_dir = out_dir / run_slug(run["name"]) / f"seed{seed}"
    done = run_dir / "result.json"
    own = {k: v for k, v in run.items() if k not in _CHAIN_KEYS}
    fields = {**merge_fields(merge_fields(base, own), overrides), "seed": seed}
    if "data" in fields:  # the MQAR format is part of the key: runs of a withdrawn format are not reused
        fields["data"] = versioned_spec(fields["data"])
    cached = cache_dir / key / "result.json"

    def recorded() -> dict | None:
        # This experiment's own record counts only when it is of these very settings (a re-run into the
        # same --out with a changed setting is another run).
        record = json.loads(done.read_text()) if done.exists() else {}
        if record.get("key") == key or cached.exists():
            result = {**(record if record.get("key") == key else json.loads(cached.read_text())),
                      "name": run["name"]}
            return _with_task_limit(result, task_limit, cached)
        return None

    result = recorded()
    row = record.get(key)
    if result is None and row is not None and row.get("task_limit") == task_limit:
        # Only in the committed record: used as it is (no model here to score again), and not copied into
        # out_dir, whose records are of runs this machine has.
        return {**row, "name": run["name"], "recorded": True}
    if result is None and finished_only:
        if progress:
            other = f" (recorded under --task-limit {row.get('task_limit')})" if row is not None else ""
            print(f"not finished: {run['name']} seed {seed}{other}", flush=True)
        return None
    if result is None:
        for what, (_, parent) in parents.items():
            if parent.get("recorded"):
                raise UsageError(f"run {run['name']!r} seed {seed} starts from {parent['name']!r} ({what}:), whose "
                                 f"result is only in the --record file: its model is not on this machine. Train "
                                 f"{parent['name']!r} here first (without --record), or add --finished-only")
        with RunLock(cache_dir / key) as lock:
            if not lock.held:
                return _HELD
            result = recorded()  # another process may have finished it while this one waited
            if result is None:
                count["started"] += 1
                if progress:
                    print(f"[{count['started']}/{count['total']}] {run['name']} seed {seed}", flush=True)
                # No result means the run did not finish: continue from its newest checkpoint (the key is
                # the whole config, so the checkpoint is this run's), or train it again from the start.
                train_dir = cache_dir / key / "train"
                start = {"resume": True} if _resumable(train_dir) else {"overwrite": True}
                if progress and "resume" in start:
                    print(f"  resuming the interrupted run in {train_dir}", flush=True)
                train_fields = _chain(fields, parents, cache_dir / key)
                cfg = TrainConfig.from_dict({**train_fields, "out_dir": str(train_dir), "progress": False, **start})
                trained = train(cfg)
                if trained.get("stopped"):  # SIGTERM / SIGINT: the checkpoint is saved, nothing to evaluate
                    raise Stopped(f"run {run['name']!r} seed {seed} stopped by {trained['stopped']} at step "
                                  f"{trained['steps']} of {trained['total_steps']} (checkpoint "
                                  f"{trained['train_checkpoint']}); re-run the same command to resume it",
                                  trained["stopped"])
                result = _summarise(run["name"], seed, trained, task_limit)
                ancestor = parents["from"][1] if "from" in parents else {}
                result["tokens_offset"] = ancestor.get("tokens_offset", 0) + ancestor.get("tokens_seen", 0)
                result["curve"] = [(t + result["tokens_offset"], v) for t, v in result["curve"]]
                if "retrieval" in evaluate:
                    result["retrieval"] = _retrieval(result["checkpoint"], evaluate["retrieval"])
                result["config"] = fields
                result["key"] = key
                write_json_atomic(cached, result)  # a killed run never leaves a half result
    result["key"] = key
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(done, result)
    return result


class RunLock:
    """An exclusive `flock` on a file in a run's cache directory while one process trains it. The kernel
    releases it when the process ends however it ends, so a killed run never leaves a stale lock."""

    def __init__(self, run_cache: Path):
        self.path = Path(run_cache) / "lock"
        self.held = False
        self._file = None

    def __enter__(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a+")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            return self
        self._file.truncate(0)  # who holds it, for a person looking (the lock itself is the flock)
        self._file.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        self._file.flush()
        self.held = True
        return self

    def __exit__(self, *exc) -> None:
        if self.held:
            self._file.close()  # closing releases the flock
            self.held = False


def _with_task_limit(result: dict, task_limit: int | None, cached: Path) -> dict:
    """A reused result scored on the local tasks under another --task-limit is scored again from its model
    (or stripped of its task scores for 0), so no table mixes limits; training is not repeated."""
    if result.get("task_limit") == task_limit:
        return result
    result = {k: v for k, v in result.items() if k != "tasks"} | {"task_limit": task_limit}
    if task_limit:
        from ..model import FusedKVForCausalLM

        model = FusedKVForCausalLM.from_pretrained(result["checkpoint"]).eval()
        result["tasks"] = _task_scores(model, result["checkpoint"], task_limit)
    write_json_atomic(cached, result)
    return result


# TrainConfig fields that say where and how verbosely a run is written, not what it computes.
_NOT_IDENTITY = ("out_dir", "progress", "resume", "overwrite")


def _resolved(fields: dict, name: str) -> dict:
    """The complete training settings of a run, as TrainConfig resolves them (the preset's values filled in);
    a ValueError naming the run when they are invalid."""
    from ..train import TrainConfig

    try:
        resolved = TrainConfig.from_dict(fields).to_dict()
    except ValueError as e:
        raise ValueError(f"run {name!r}: {e}") from e
    return {k: v for k, v in resolved.items() if k not in _NOT_IDENTITY}


def _resumable(train_dir: Path) -> bool:
    """A run killed part-way: it has a checkpoint but no final model (a run killed after its final model
    was written, while being evaluated, is trained again: there is nothing left to resume)."""
    from ..train import full_checkpoint as ckpt_io

    root = ckpt_io.checkpoint_root(train_dir)
    return root.is_dir() and bool(ckpt_io.list_checkpoints(root)) and not (train_dir / "final").exists()


# Run keys that say where a run starts, not how it trains (they are not TrainConfig fields).
_CHAIN_KEYS = ("name", "from", "distill")


def _chain(fields: dict, parents: dict, work: Path) -> dict:
    """The training fields of a chained run: `init_from` the parent's final model (converted to this run's
    plan when it differs), `distill_from` the teacher's. The architecture then comes from the checkpoint, so
    the base's model overrides are dropped."""
    if "from" not in parents and "distill" not in parents:
        return fields
    fields = dict(fields)
    if "distill" in parents:
        fields["distill_from"] = parents["distill"][1]["checkpoint"]
    if "from" not in parents:
        return fields
    from ..train.config import normalise

    parent = parents["from"][1]
    fields = normalise(fields)  # TrainConfig's names: the plan is `kv_sharing` whichever alias the file used
    plan = fields.pop("kv_sharing", None)
    fields.pop("model", None)
    fields.pop("vocab_size", None)
    init = parent["checkpoint"]
    if plan is not None and resolve_plan_choice(plan).sharing != parent["plan"]:
        from ..convert import convert_qwen3

        converted = work / "converted"
        if not (converted / "config.json").is_file():
            convert_qwen3(init, converted, kv_sharing=plan, overwrite=True)
        init = str(converted)
    fields["init_from"] = init
    return fields


def _retrieval(checkpoint: str, settings: dict) -> dict:
    """Retrieval accuracy of a finished run at the configured lengths that fit its context."""
    from transformers import AutoTokenizer

    from ..eval.retrieval import DEFAULT_PAIRS, run_retrieval
    from ..model import FusedKVForCausalLM

    model = FusedKVForCausalLM.from_pretrained(checkpoint).eval()
    tok = AutoTokenizer.from_pretrained(checkpoint)
    context = model.config.max_position_embeddings
    lengths = [L for L in settings.get("lengths", [context]) if L <= context]
    return run_retrieval(model, tok, lengths, settings.get("pairs", DEFAULT_PAIRS), settings.get("samples", 20))


def _summarise(name: str, seed: int, res: dict, task_limit: int | None) -> dict:
    from ..model import FusedKVForCausalLM

    ckpt = res["checkpoint"]
    model = FusedKVForCausalLM.from_pretrained(ckpt).eval()
    c = model.config
    out = dict(
        name=name, seed=seed, plan=c.kv_sharing, checkpoint=str(ckpt),
        val_loss=res["val_loss"], val_ppl=res.get("val_ppl", math.exp(res["val_loss"])),
        cache=c.kv_cache_fraction(),
        curve=[(r["tokens"], r["val_loss"]) for r in res.get("val_curve", []) if r.get("val_loss") is not None],
        tokens_per_s=res.get("tokens_per_s"), tokens_seen=res.get("tokens_seen"),
        init_val_loss=res.get("init_val_loss"),  # a run started from another model: its loss before training
        task_limit=task_limit,
    )
    if out["init_val_loss"] is not None:
        out["curve"].insert(0, (0, out["init_val_loss"]))
    if task_limit:
        out["tasks"] = _task_scores(model, ckpt, task_limit)
    return out


def _task_scores(model, ckpt, limit: int) -> dict:
    """Accuracy on the shipped local lm-eval tasks (offline)."""
    from transformers import AutoTokenizer

    from ..eval.harness import LOCAL_TASKS, run_lm_eval

    tok = AutoTokenizer.from_pretrained(ckpt)
    # Only the accuracies are kept: no bootstrapped standard errors (lm-eval's 100k resamples of perplexity).
    results = run_lm_eval(model, tok, tasks=list(LOCAL_TASKS), limit=limit, num_fewshot=0, bootstrap_iters=0)["results"]
    return {task: round(results[task]["acc"], 4) for task in LOCAL_TASKS}
