"""The uptraining journey as stages, each leaving a file or directory in OUT that marks it done.

    OUT/uptrain.json     the settings (a re-run must ask for the same run, or pass --overwrite)
    OUT/converted/       1. the source converted to the plan (fusedkv.convert; written atomically)
    OUT/eval/teacher.json, before.json
                         2. held-out loss of the source (run by transformers) and of the converted model
    OUT/train/           3. distillation from the source (fusedkv.train: its checkpoints resume a killed run)
    OUT/eval/after.json  4. held-out loss after training
    OUT/report.md, report.json, curves.png
                         5. the report (rewritten on every run: it is cheap)

A killed run, re-run with the same command, skips the stages that are done and resumes training from its
last checkpoint. Every check that reads only the inputs runs first (`check`: the source, the context, the
batch split), then the data is tokenised and measured (into the shared data cache), so bad input is one line
before anything in OUT is written. `--overwrite` replaces a run as `fusedkv train --overwrite` does: only
once the new run is known to start (checked, data ready, the source converted beside the old run) are the
old run's files removed (`rundir.clear_previous_run`), and the conversion renamed into place. A run that
failed before making anything (OUT holds its settings only) is no run: a corrected command starts afresh.
Paths are compared resolved: the same run named by a relative or an absolute path is the same run.
Under torchrun every rank runs this module; rank 0 alone converts, prepares
the data and evaluates (before the process group exists, so that a large model's preparation cannot
outlast its timeout; the other ranks wait for a file), all ranks train (DDP / FSDP2, as `fusedkv
train`), and rank 0 evaluates the result and reports.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import FusedKVConfig
from ..convert import convert_qwen3
from ..errors import Stopped, UsageError
from ..model_dirs import check_checkpoint_dir
from ..plan import VANILLA
from ..train import TrainConfig, train
from ..train import data as data_setup
from ..train import distributed as D
from ..train import full_checkpoint as ckpt_io
from ..train.distill import TEACHER_MODEL_TYPES, check_teacher, load_teacher, teacher_student_configs
from ..train.run_setup import RESUME_MAY_CHANGE, same_file
from ..train.rundir import RunDirLock, clear_previous_run
from ..utils import write_json_atomic
from .report import write_report

SETTINGS = "uptrain.json"
# What a run writes into OUT; --overwrite removes exactly these (the settings first: a run without them is
# no run to continue).
OUTPUTS = (SETTINGS, "converted", "train", "eval", "report.md", "report.json", "curves.png")
# Settings that name files: compared resolved (a run written before they were stored absolute has them as
# typed, relative to where it was started).
PATH_SETTINGS = ("src", "train.data", "train.tokenizer", "train.distill_from")
STAGED = ".converted.new"  # --overwrite converts here first, beside the run it replaces
STAGES = ("convert", "evaluate before", "train", "evaluate after", "report")


@dataclass(frozen=True)
class Uptrain:
    """One uptraining run: the source, the plan, and the training config (init_from / distill_from / out_dir
    already pointing into OUT)."""

    src: Path
    out: Path
    plan: str
    fusion_init: str
    cfg: TrainConfig
    command: str = ""  # as typed, for the report
    calibration: dict | None = None  # `fusedkv.calibrate.Calibration` fields, with --fusion-init calibrated

    @property
    def converted(self) -> Path:
        return self.out / "converted"

    @property
    def train_dir(self) -> Path:
        return self.out / "train"

    def eval_file(self, which: str) -> Path:
        return self.out / "eval" / f"{which}.json"

    def settings(self) -> dict:
        """What defines the run: a re-run may change only what a resumed `fusedkv train` may change."""
        cfg = {k: v for k, v in self.cfg.to_dict().items() if k not in RESUME_MAY_CHANGE}
        calib = {"calibration": self.calibration} if self.calibration is not None else {}
        return {"src": str(self.src.resolve()), "plan": self.plan, "fusion_init": self.fusion_init, "train": cfg,
                **calib}


def source_config(src: Path, plan: str) -> tuple[FusedKVConfig, FusedKVConfig]:
    """(the source as a vanilla FusedKVConfig, the converted model's config), from config.json alone."""
    return teacher_student_configs(json.loads((src / "config.json").read_text()), plan, origin=str(src))


def check(run: Uptrain, overwrite: bool) -> None:
    """Every check that needs only the inputs; reads, writes nothing (bad input: one line, exit 2)."""
    src, out = run.src, run.out
    if not src.exists():
        raise UsageError(f"SRC {src} does not exist; give the pretrained model's checkpoint directory (config.json, "
                         "*.safetensors, tokenizer files)")
    check_checkpoint_dir(src, model_types=TEACHER_MODEL_TYPES)
    if not data_setup.has_tokenizer(src):
        raise UsageError(f"{src} has no tokenizer (tokenizer.json / tokenizer_config.json): uptraining reads the "
                         "data as the source model does; copy its tokenizer files into the checkpoint directory")
    teacher, student = source_config(src, run.plan)
    if student.kv_sharing == VANILLA:
        raise UsageError(f"--plan {run.plan}: the source already is a full-cache model; choose a plan that shares "
                         "the KV cache (see `fusedkv plans`)")
    check_teacher(src, student.vocab_size, run.cfg.tokenizer, run.cfg.data)
    data_setup.plan_data(run.cfg, student.vocab_size)  # the data source, its vocabulary and tokenizer
    cfg = run.cfg
    cfg.grad_accum_steps(int(os.environ.get("WORLD_SIZE", "1")))  # the global batch splits into micro-batches
    context = teacher.max_position_embeddings
    if cfg.seq_len > context:  # the teacher (transformers' class) reads every training window
        raise UsageError(f"seq_len={cfg.seq_len} is past the context of {src} ({context} tokens, its "
                         f"max_position_embeddings): the source is the teacher of every window; use --set "
                         f"seq_len=N with N <= {context}")
    if out.exists() and not out.is_dir():
        raise UsageError(f"OUT {out} is a file; give a directory for the uptraining run")
    if src.resolve() == out.resolve() or out.resolve() in src.resolve().parents:
        raise UsageError(f"OUT {out} would hold the source {src}; choose another directory")
    saved = out / SETTINGS
    if overwrite or not _holds_results(out):
        return
    if not saved.is_file():
        raise UsageError(f"OUT {out} already holds files that are not an uptraining run; choose a new directory "
                         "or pass --overwrite (deletes them)")
    before, now = json.loads(saved.read_text()), json.loads(json.dumps(run.settings()))
    diffs = [d for d in _differences(before, now) if not _same_path(before, now, d)]
    if diffs:
        raise UsageError(f"OUT {out} holds an uptraining run with other settings ({'; '.join(diffs[:4])}); re-run "
                         "with the same settings to continue it, --overwrite to start over, or choose a new OUT")


def _holds_results(out: Path) -> bool:
    """OUT holds something a run made (its settings alone, or hidden temporaries, are nothing to keep)."""
    return out.is_dir() and any(not p.name.startswith(".") and p.name != SETTINGS for p in out.iterdir())


def _differences(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _differences(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [f"{prefix[:-1]}: was {a!r}, now {b!r}"]


def _same_path(before: dict, now: dict, diff: str) -> bool:
    """A difference in a setting that names a file, which both values name (resolved from here)."""
    key = diff.split(":", 1)[0]
    if key not in PATH_SETTINGS:
        return False
    a, b = before, now
    for part in key.split("."):
        a, b = (a or {}).get(part), (b or {}).get(part)
    return same_file(a, b)


def run_uptrain(run: Uptrain, overwrite: bool = False, progress: bool = True) -> dict:
    """The whole journey (module docstring); returns the report's numbers. Collective under torchrun."""
    check(run, overwrite)
    cfg = run.cfg
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    say = (lambda msg: print(msg, flush=True)) if (progress and rank == 0) else (lambda msg: None)
    with RunDirLock(run.out) if rank == 0 else _nothing():
        # Converting, tokenising and evaluating a large model can outlast a process group's timeout, so rank 0
        # does it before the group exists; the other ranks wait for its word in a file (`_Ready`).
        ready = _Ready(run.out) if world > 1 else None
        if rank == 0:
            try:
                _prepare(run, overwrite, say, D.pick_device(cfg.device, int(os.environ.get("LOCAL_RANK", "0"))),
                         progress)
            except BaseException as e:
                if ready is not None:
                    ready.tell(f"{type(e).__name__}: {e}")
                raise
            if ready is not None:
                ready.tell(None)
        else:
            ready.wait()
        env = D.setup(cfg.distributed, cfg.device)
        try:
            summary = _train(run, say)
            result, error = None, None
            if env.is_main:
                try:
                    after = _evaluate(run, "after", run.train_dir / "final", env.device, progress, say,
                                      steps=summary["steps"])
                    result = write_report(run, summary, after, say)
                except Exception as e:
                    error = e
            D.raise_if_failed(error, env, "could not evaluate the trained model or write the report")
            return result or {}
        finally:
            if ready is not None and env.is_main:
                ready.clear()
            D.teardown(env)


class _Ready:
    """Rank 0's word to the other ranks of this torchrun launch (its run id names the file): prepared, or the
    error that stopped it."""

    def __init__(self, out: Path):
        self.path = out / f".uptrain-ready-{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}.json"

    def tell(self, error: str | None) -> None:
        write_json_atomic(self.path, {"error": error})

    def wait(self) -> None:
        while not self.path.is_file():
            time.sleep(1.0)
        error = json.loads(self.path.read_text())["error"]
        if error is not None:
            raise ValueError(f"rank 0 could not convert, prepare the data or evaluate: {error}")

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _prepare(run: Uptrain, overwrite: bool, say, device, progress: bool) -> None:
    """Stages 1-2 (rank 0): tokenise the data (and refuse too little of it), convert, evaluate the source and
    the converted model. The lock is held: nothing else writes into OUT."""
    _dataset(run)  # before OUT is touched: the data cache is shared, outside OUT
    staged = run.out / STAGED
    shutil.rmtree(staged, ignore_errors=True)  # a killed --overwrite's conversion
    if overwrite and _holds_results(run.out):
        # --overwrite: the new run is known to start once its source is converted; only then is the old removed
        say(f"uptrain [1/5] convert {run.src} -> {run.converted} (plan {run.plan}; replaces the run in {run.out})")
        _convert(run, staged, progress)
        removed = clear_previous_run(run.out, OUTPUTS)
        os.replace(staged, run.converted)
        say(f"uptrain: --overwrite removed the previous run's {', '.join(n for n in removed if n != 'converted')}")
    elif not _holds_results(run.out):
        clear_previous_run(run.out, (SETTINGS,))  # the settings of a run that made nothing: start afresh
    write_json_atomic(run.out / SETTINGS, run.settings())
    if (run.converted / "config.json").is_file():
        if not overwrite:
            say(f"uptrain [1/5] convert: done ({run.converted})")
    else:
        say(f"uptrain [1/5] convert {run.src} -> {run.converted} (plan {run.plan})")
        _convert(run, run.converted, progress)
    _evaluate(run, "teacher", run.src, device, progress, say)
    _evaluate(run, "before", run.converted, device, progress, say)


def _convert(run: Uptrain, dst: Path, progress: bool = False) -> None:
    if run.calibration is not None:
        from ..calibrate import Calibration, convert_calibrated

        convert_calibrated(run.src, dst, run.plan, Calibration(**run.calibration), overwrite=True, progress=progress)
    else:
        convert_qwen3(run.src, dst, kv_sharing=run.plan, fusion_init=run.fusion_init, overwrite=True)


def _dataset(run: Uptrain):
    """The prepared data the trainer uses (tokenised with the source's tokenizer; made once, then reused); a
    split too short for one training or validation window is refused, naming both."""
    cfg = run.cfg
    vocab = source_config(run.src, run.plan)[1].vocab_size  # the converted model's
    spec, data_dir, tokenizer = data_setup.plan_data(cfg, vocab)
    ds = data_setup.prepare(spec, data_dir, vocab, tokenizer)
    for split, tokens in (("training", ds.train), ("validation", ds.val)):
        if len(tokens) < cfg.seq_len + 1:
            raise UsageError(f"the {split} split of {spec} has {len(tokens)} tokens, fewer than seq_len + 1 = "
                             f"{cfg.seq_len + 1}; use more data or a shorter seq_len (--set seq_len=N)")
    return ds, spec


def _evaluate(run: Uptrain, which: str, model_dir: Path, device, progress: bool, say, steps: int | None = None):
    """Held-out loss of one model on the validation split, the same windows as the trainer's final evaluation
    (seq_len tokens, final_eval_batches batches); cached in OUT/eval/WHICH.json."""
    from tqdm.auto import tqdm

    from ..data import iter_eval_batches
    from ..eval.perplexity import validation_loss

    path = run.eval_file(which)
    step = {"teacher": "2/5", "before": "2/5", "after": "4/5"}[which]
    if path.is_file():
        saved = json.loads(path.read_text())
        if steps is None or saved.get("steps") == steps:
            say(f"uptrain [{step}] evaluate {which}: done (loss {saved['val_loss']:.4f})")
            return saved
    cfg = run.cfg
    ds, spec = _dataset(run)
    n_windows = (len(ds.val) - 1) // cfg.seq_len
    n_batches = min(-(-n_windows // cfg.micro_batch_size), cfg.final_eval_batches)
    if which == "teacher":  # the source as transformers runs it, as the trainer's teacher is
        model = load_teacher(model_dir, device)
    else:
        from ..model import FusedKVForCausalLM

        model = FusedKVForCausalLM.from_pretrained(model_dir).float().to(device).eval()
    batches = tqdm(iter_eval_batches(ds.val, cfg.seq_len, cfg.micro_batch_size, max_batches=n_batches),
                   total=n_batches, desc=f"uptrain [{step}] evaluate {which}", unit="batch", disable=not progress,
                   leave=False)
    use_bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and torch.device(device).type == "cuda")
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=use_bf16):
        loss = validation_loss(model, batches, shifted=True, device=device)
    result = {"model": str(model_dir), "class": type(model).__name__, "val_loss": loss,
              "val_ppl": math.exp(min(loss, 50.0)), "tokens": min(n_batches * cfg.micro_batch_size, n_windows)
              * cfg.seq_len, "data": spec, "seq_len": cfg.seq_len, "steps": steps}
    del model
    write_json_atomic(path, result)
    say(f"uptrain [{step}] evaluate {which}: loss {loss:.4f} (ppl {result['val_ppl']:.2f})")
    return result


def _train(run: Uptrain, say) -> dict:
    """Stage 3 (every rank): `fusedkv train --init-from converted --distill-from SRC`, resumed from its last
    checkpoint when one exists; skipped when its final model is there for this many steps."""
    cfg, out = run.cfg, run.train_dir
    summary_file = out / "summary.json"
    if (out / "final").is_dir() and summary_file.is_file():
        summary = json.loads(summary_file.read_text())
        if not summary.get("stopped") and summary.get("steps") == cfg.total_steps():
            say(f"uptrain [3/5] train: done ({summary['steps']} steps, {out / 'final'})")
            return summary
    resume = bool(ckpt_io.list_checkpoints(ckpt_io.checkpoint_root(out)))
    say(f"uptrain [3/5] train: distil {run.src} into {run.converted}" + (" (resuming)" if resume else ""))
    result = train(cfg.replace(resume=True) if resume else cfg)
    if result.get("stopped"):
        raise Stopped(f"stopped by {result['stopped']} during training; the checkpoint is saved: re-run the same "
                      "`fusedkv uptrain` command to continue", result["stopped"])
    return result
