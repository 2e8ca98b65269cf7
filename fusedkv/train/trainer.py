"""`train(cfg)`: pre-train (or continue training) a FusedKV language model; the whole run in one call.

What a run does, in order (everything that can fail on bad input fails before anything is written):

0. Lock `out_dir` (rundir.RunDirLock, an OS lock held until the run ends): a second run there is
   refused at once, naming the holder.
1. Look at `out_dir`: pick and verify the checkpoint to resume (rundir.find_resume_checkpoint: the
   newest that verifies), or refuse to start over an existing run unless `overwrite`; check a resumed
   config against the saved one; a finished run has nothing to resume.
2. Build the model config (preset dims + plan, or `init_from`'s config with a new RoPE base/context).
3. Prepare the data (rank 0; a tokenizer of the model's vocab size) and the batch streams.
4. Build the model (seeded), load `init_from` weights, activation checkpointing, compile, DDP/FSDP2
   wrap, AdamW + warm-up/cosine schedule. Only now does `overwrite` remove the old run's files; then
   restore everything from the checkpoint when resuming. (Steps 1-4: `_Run.setup`.)
5. Train: gradient accumulation to the global batch, clipping, periodic validation, metrics to
   CSV/TensorBoard, checkpoints every `ckpt_every` steps and on SIGINT/SIGTERM. A non-finite loss
   or gradient stops the run with `TrainingDiverged` (exit 1) and leaves the last good checkpoint
   alone; a full disk stops it with a `RunError` naming the file and the last good checkpoint.
6. Final validation, `save_pretrained` model + tokenizer + integrity manifest into `out_dir/final/`,
   learning-curve PNG, `summary.json`, and the printed summary (loss/perplexity next to the KV cache).

Checkpoint entry points: `_Run._save` (every rank; rank 0 writes via checkpoint.save_checkpoint),
`_Run.setup` (loads via checkpoint.load_checkpoint + distributed.load_full_state), `_Run._save_final`.

`train` is re-entrant (the experiment runner calls it for many plans and seeds in one process):
it restores signal handlers, destroys only process groups it created, and is silent when
`cfg.progress` is False. It returns the final metrics and the learning curve.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ..checkpoints import check_checkpoint_dir, write_manifest
from ..config import FusedKVConfig
from ..data import TokenBatches, iter_eval_batches
from ..data.tokenizer import with_chat_template
from ..errors import RunError, UsageError, describe_os_error
from ..model import FusedKVForCausalLM
from ..model.loss import causal_lm_loss, lm_loss
from ..utils import replace_dir, write_json_atomic
from . import checkpoint as ckpt_io
from . import data as data_setup
from . import dcp as dcp_io
from . import distributed as D
from .config import TrainConfig, normalise
from .distill import TEACHER_MODEL_TYPES, Distiller, check_teacher
from .metrics import MetricsLogger, format_summary, plot_learning_curves
from .optim import build_optimizer, build_scheduler
from .rundir import RunDirBusy, RunDirLock, clear_previous_run, find_resume_checkpoint

# A run started from another model (--init-from) records its validation loss before the first step here.
INIT_EVAL = "init_eval.json"


def _read_init_eval(out: Path) -> float | None:
    path = out / INIT_EVAL
    return json.loads(path.read_text())["val_loss"] if path.is_file() else None


# Fields a resumed run may change; any other difference would make it a different experiment.
RESUME_MAY_CHANGE = {
    "preset",
    "max_steps",
    "max_tokens",
    "eval_every",
    "eval_batches",
    "final_eval_batches",
    "ckpt_every",
    "keep_checkpoints",
    "out_dir",
    "resume",
    "overwrite",
    "progress",
    "distributed",
    "device",
    "dtype",
    "compile",
    "grad_checkpointing",
    "micro_batch_size",
    "data_dir",
    "init_from",
    "threads",
    "checkpoint_format",
}
# Model fields that --init-from may change: none of them changes a parameter's shape.
INIT_FROM_MAY_CHANGE = {
    "max_position_embeddings",
    "rms_norm_eps",
    "attention_dropout",
    "use_cache",
    "initializer_range",
}
# Seconds to sleep after every step: lets tests and demos interrupt a run at a known point.
STEP_SLEEP_ENV = "FUSEDKV_TRAIN_STEP_SLEEP"


class TrainingDiverged(RunError):
    """The loss or gradient became NaN/inf; the last good checkpoint was kept, nothing was saved (exit 1)."""


# The training objective (fusedkv/model/loss.py); a module global, so tests can wrap it.
compute_loss = causal_lm_loss


def train(cfg: TrainConfig) -> dict:
    """Run one training job described by `cfg`; returns final metrics (see `_Run.result`)."""
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"train() takes a TrainConfig, got {type(cfg).__name__}")
    env = D.setup(cfg.distributed, cfg.device)
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        with contextlib.ExitStack() as hold:
            error = None
            if env.is_main:  # one run per out_dir, held until the run ends (see rundir.RunDirLock)
                try:
                    hold.enter_context(RunDirLock(cfg.out_dir))
                except RunDirBusy as e:
                    error = e
            D.raise_if_failed(error, env, "could not lock the run directory")
            return _Run(cfg, env).run()
    finally:
        torch.set_num_threads(threads)
        D.teardown(env)


@contextlib.contextmanager
def _quiet_transformers(quiet: bool):
    """transformers draws progress bars when saving/loading weights; keep library use silent."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if quiet and was:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if quiet and was:
            hf_logging.enable_progress_bar()


class _Run:
    """One training job. `setup()` builds everything the loop needs, all of it in one place, and
    returns where training starts; `run()` is setup + loop + finish. The attributes below are None
    until `setup()` has run."""

    mc: FusedKVConfig  # the model config (final: data-dependent token ids filled in)
    ds: object  # the prepared dataset (train/val token streams, tokenizer)
    batches: TokenBatches  # this rank's stream of global-batch rows (its position is checkpointed)
    model: torch.nn.Module  # the plain FusedKVForCausalLM (FSDP2 shards it in place)
    wrapped: torch.nn.Module  # what the training step calls: DDP(model), or model itself
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    accum: int  # micro-batches per optimiser step on each rank
    total: int  # optimiser steps of the whole run
    use_bf16: bool  # bf16 autocast

    def __init__(self, cfg: TrainConfig, env: D.DistEnv):
        self.cfg, self.env = cfg, env
        self.out = Path(cfg.out_dir)
        self.verbose = cfg.progress and env.is_main
        self.sharded = None  # dcp.ShardedCheckpointer, made at the first sharded save
        self.pbar = None
        self.mc = self.ds = self.batches = self.model = self.wrapped = self.opt = self.sched = None
        self.accum = self.total = 0
        self.use_bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and env.device.type == "cuda")
        self.distiller = None  # distill.Distiller when cfg.distill_from: replaces compute_loss

    def warn(self, msg: str) -> None:
        """Shown even when quiet (rank 0): the run goes on, but the user must know."""
        if self.env.is_main:
            (self.pbar.write if self.pbar is not None else print)(f"fusedkv train: warning: {msg}", file=sys.stderr)

    def say(self, msg: str) -> None:
        if self.verbose:
            if self.pbar is not None:
                self.pbar.write(msg)
            else:
                print(msg, flush=True)

    # ---- 1. out_dir and the checkpoint to resume ------------------------------------------------------
    def _checkpoint_to_resume(self) -> Path | None:
        cfg = self.cfg
        if not cfg.resume:
            existing = ckpt_io.list_checkpoints(ckpt_io.checkpoint_root(self.out))
            if (existing or (self.out / "final").exists()) and not cfg.overwrite:
                what = f"checkpoint {existing[-1].name}" if existing else "a final model"
                raise ValueError(
                    f"out_dir {self.out} already holds a training run ({what}); pass --resume to continue "
                    "it, --overwrite to start over (deletes it), or choose another --out"
                )
            return None
        point = find_resume_checkpoint(self.out if cfg.resume is True else cfg.resume)
        for w in point.warnings:
            self.warn(w)
        return point.checkpoint

    def _check_finished(self, step: int, total: int) -> None:
        """Resuming a run that has nothing left to do is refused, saying so (exit 2)."""
        if step > total:
            raise UsageError(
                f"the checkpoint is at step {step}, past the run's last step {total}; pass --max-steps N with "
                f"N >= {step} (or resume an earlier checkpoint)"
            )
        if step == total and (self.out / "final").is_dir():
            raise UsageError(
                f"the run in {self.out} already finished (step {step} of {total}; the model is in "
                f"{self.out / 'final'}): nothing to resume. Pass --max-steps N with N > {step} to train further, "
                "or --overwrite to start over"
            )

    def _check_resume_config(self, saved: dict) -> TrainConfig:
        """The config to resume with: fields left unset (None) take the saved values; any other
        difference in a field that defines the run is an error."""
        saved = normalise(saved)  # checkpoints written before the fields were renamed (plan, rope_base)
        mine = json.loads(json.dumps(self.cfg.to_dict()))
        adopt = {
            k: saved[k]
            for k in ("kv_sharing", "vocab_size", "tokenizer", "rope_theta")
            if mine.get(k) is None and saved.get(k) is not None
        }
        mine.update(adopt)
        diffs = [
            f"{k}: saved {saved.get(k)!r}, now {mine[k]!r}"
            for k in mine
            if k not in RESUME_MAY_CHANGE and k in saved and saved[k] != mine[k]
        ]
        if diffs:
            raise ValueError(
                "cannot resume: the config differs from the checkpoint's in fields that define the "
                "run (" + "; ".join(diffs) + "). Resume with the original settings or start a new run"
            )
        return self.cfg.replace(**adopt) if adopt else self.cfg

    # ---- 2. model config ------------------------------------------------------------------------------
    def _model_config(self, ckpt: dict | None) -> FusedKVConfig:
        cfg = self.cfg
        if ckpt is not None:
            return FusedKVConfig.from_dict(ckpt["model_config"])
        if cfg.init_from is not None:
            check_checkpoint_dir(cfg.init_from)
            mc = FusedKVConfig.from_pretrained(cfg.init_from)
            if cfg.kv_sharing is not None and cfg.plan_choice.sharing != mc.kv_sharing:
                raise ValueError(
                    f"plan={cfg.kv_sharing!r} but init_from={cfg.init_from} holds a {mc.kv_sharing!r} model; "
                    "a checkpoint keeps its plan (leave --plan unset)"
                )
            if cfg.vocab_size is not None and cfg.vocab_size != mc.vocab_size:
                raise data_setup.vocab_mismatch(f"init_from={cfg.init_from}", mc.vocab_size, cfg.vocab_size)
            bad = sorted(set(cfg.model) - INIT_FROM_MAY_CHANGE)
            if bad:
                raise ValueError(
                    f"model.{bad[0]}: cannot change when initialising from a checkpoint (it would not "
                    f"match the saved weights); only {sorted(INIT_FROM_MAY_CHANGE)} may change"
                )
            for k, v in cfg.model.items():
                setattr(mc, k, v)
            if cfg.rope_theta is not None:
                mc.rope_parameters = {**mc.rope_parameters, "rope_theta": float(cfg.rope_theta)}
        else:
            mc = cfg.model_config()
        # Train at seq_len: the model must accept it (continued training at a longer context).
        mc.max_position_embeddings = max(mc.max_position_embeddings, cfg.seq_len)
        mc.check()
        return mc

    # ---- 3. data --------------------------------------------------------------------------------------
    def _data(self, vocab_size: int):
        spec, data_dir, tokenizer = data_setup.plan_data(self.cfg, vocab_size)
        error = None
        ds = None
        if self.env.is_main:
            prepared = data_setup.is_prepared_dir(spec)
            self.say(f"data: {spec} (prepared)" if prepared else f"data: {spec} -> {data_dir}")
            try:
                ds = data_setup.prepare(spec, data_dir, vocab_size, tokenizer)
            except Exception as e:  # tell the other ranks instead of leaving them at the barrier
                error = e
        D.raise_if_failed(error, self.env, "could not prepare the data")
        if ds is None:
            ds = data_setup.open_prepared(spec, data_dir)
        if len(ds.val) < self.cfg.seq_len + 1:
            raise ValueError(
                f"the validation split of {spec} has {len(ds.val)} tokens, fewer than seq_len + 1 = "
                f"{self.cfg.seq_len + 1}; use more data or a shorter seq_len"
            )
        return ds

    # ---- the run --------------------------------------------------------------------------------------
    def run(self) -> dict:
        t_start = time.time()
        step, tokens, history = self.setup()
        try:
            return self._loop(step, tokens, history, t_start)
        except OSError as e:  # metrics, TensorBoard, summary: a full disk is a failure, not a traceback
            raise RunError(
                f"{describe_os_error(e)}; the last good checkpoint is {self._last_good()}: free some space and "
                f"continue with `fusedkv train --resume {self.out}`"
            ) from e

    def setup(self) -> tuple[int, int, list[dict]]:
        """Steps 1-4 of the module docstring; returns (step, tokens seen, history) to start from."""
        cfg, env = self.cfg, self.env
        if cfg.distill_from is not None:  # a missing teacher fails before any data is prepared
            check_checkpoint_dir(cfg.distill_from, model_types=TEACHER_MODEL_TYPES)
        resume_path = self._checkpoint_to_resume()
        ckpt = None
        if resume_path is not None:  # a sharded checkpoint's tensors are read once the model is built
            load = dcp_io.read_checkpoint if dcp_io.is_sharded(resume_path) else ckpt_io.load_checkpoint
            ckpt = load(resume_path)
        if ckpt is not None:
            self.cfg = cfg = self._check_resume_config(ckpt["train_config"])
            self._check_finished(ckpt["step"], cfg.total_steps())
        if (
            ckpt is None
            and cfg.init_from is not None
            and cfg.tokenizer is None
            and data_setup.has_tokenizer(cfg.init_from)
        ):
            # Continued training must see text tokenised exactly as before.
            self.cfg = cfg = cfg.replace(tokenizer=str(cfg.init_from))
        mc = self._model_config(ckpt)
        if cfg.distill_from is not None:  # same vocabulary and tokenizer as the student, before any data is read
            tokenizer = check_teacher(cfg.distill_from, mc.vocab_size, cfg.tokenizer, cfg.data)
            self.cfg = cfg = cfg.replace(tokenizer=tokenizer)
        if cfg.kv_sharing is None or cfg.vocab_size is None:  # init_from: the checkpoint's
            self.cfg = cfg = cfg.replace(kv_sharing=mc.kv_sharing, vocab_size=mc.vocab_size)
        ds = self._data(mc.vocab_size)
        mc.eos_token_id = mc.bos_token_id = ds.eos_id
        if ckpt is None and cfg.init_from is None:
            mc.pad_token_id = ds.meta.get("pad_id")

        accum = cfg.grad_accum_steps(env.world_size)
        total = cfg.total_steps()
        batches = TokenBatches(
            ds.train,
            cfg.seq_len,
            accum * cfg.micro_batch_size,
            seed=cfg.seed,
            rank=env.rank,
            world_size=env.world_size,
        )

        model, wrapped, opt, sched = self._build(mc, ckpt)
        if cfg.distill_from is not None:
            self.distiller = Distiller(cfg.distill_from, mc, env.device, cfg.distill_alpha, cfg.distill_temperature,
                                       cfg.distill_hidden_weight)
            self.say(f"distilling from {cfg.distill_from} (alpha {cfg.distill_alpha:g}, temperature "
                     f"{cfg.distill_temperature:g}, hidden-state weight {cfg.distill_hidden_weight:g})")
        # Config validated, data ready, model built: only now may an old run be replaced. Nothing in
        # out_dir was written or deleted before this point (but the lock file).
        if env.is_main:
            if cfg.overwrite and not cfg.resume:
                removed = clear_previous_run(self.out)
                if removed:
                    self.say(f"--overwrite: removed the previous run's {', '.join(removed)} from {self.out}")
            self.out.mkdir(parents=True, exist_ok=True)
            ckpt_io.remove_stale_temporaries(ckpt_io.checkpoint_root(self.out))
        D.barrier(env)
        step, tokens, history = 0, 0, []
        if ckpt is not None:
            ts = ckpt["trainer_state"]
            if ckpt.get("sharded"):  # any saved world size and layout: DCP reshards to this one
                dcp_io.load_into(ckpt["path"], model, opt)
            else:
                D.load_full_state(model, opt, ckpt["model"], ckpt["optimizer"])
            sched.load_state_dict(ts["scheduler"])
            batches.load_state_dict(ts["data"])
            rngs = ts["rng"]
            ckpt_io.restore_rng(rngs[env.rank] if len(rngs) == env.world_size else rngs[0])
            step, tokens, history = int(ts["step"]), int(ts["tokens_seen"]), list(ts["history"])
            if ts.get("total_steps") not in (None, total):
                self.say(
                    f"note: total steps changed {ts['total_steps']} -> {total}: the cosine schedule is "
                    "recomputed for the new length"
                )
            self.say(f"resumed from {resume_path} at step {step} ({tokens:,} tokens)")
            del ckpt  # the state dicts can be large
        self.model, self.wrapped, self.opt, self.sched, self.batches = model, wrapped, opt, sched, batches
        self.mc, self.ds, self.accum, self.total = mc, ds, accum, total
        return step, tokens, history

    def _build(self, mc: FusedKVConfig, ckpt):
        cfg, env = self.cfg, self.env
        # Same seed on every rank: identical initial weights (FSDP shards them, DDP checks them).
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        with _quiet_transformers(not self.verbose):
            if ckpt is None and cfg.init_from is not None:
                model, info = FusedKVForCausalLM.from_pretrained(
                    cfg.init_from, config=mc, output_loading_info=True
                )
                bad = {k: v for k, v in info.items() if v and k != "error_msgs"}
                if bad or info.get("error_msgs"):
                    raise ValueError(
                        f"init_from={cfg.init_from}: weights do not match the model ({bad or info})"
                    )
                model = model.float()
                self.say(
                    f"initialised from {cfg.init_from} (RoPE base {mc.rope_theta:g}, "
                    f"context {mc.max_position_embeddings})"
                )
            else:
                model = FusedKVForCausalLM(mc)
        model.to(env.device).train()
        if cfg.grad_checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": False})
        if cfg.compile:
            for layer in model.model.layers:  # per layer: names stay, and FSDP2/DDP wrap as usual
                layer.compile()
        wrapped = D.wrap_model(
            model, env, torch.bfloat16 if self.use_bf16 and env.device.type == "cuda" else None
        )
        opt = build_optimizer(model, cfg)
        sched = build_scheduler(opt, cfg, cfg.total_steps())
        return model, wrapped, opt, sched

    def _autocast(self):
        if self.use_bf16:
            return torch.autocast(self.env.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @torch.no_grad()
    def evaluate(self, max_batches: int | None) -> float:
        """Mean validation loss per token over the first `max_batches` micro-batches of the val split.
        Ranks split the batches; under FSDP every rank must run the same number of forwards (they
        all-gather parameters), so ranks with fewer batches run a zero-weight dummy forward."""
        env, cfg = self.env, self.cfg
        model = self.wrapped if env.mode == "fsdp" else D.unwrap(self.wrapped)
        n_windows = (len(self.ds.val) - 1) // cfg.seq_len
        n_batches = -(-n_windows // cfg.micro_batch_size)
        if max_batches is not None:
            n_batches = min(n_batches, max_batches)
        mine = list(
            iter_eval_batches(
                self.ds.val,
                cfg.seq_len,
                cfg.micro_batch_size,
                max_batches=n_batches,
                rank=env.rank,
                world_size=env.world_size,
            )
        )
        rounds = -(-n_batches // env.world_size)
        total = torch.zeros(2, dtype=torch.float64, device=env.device)
        self.model.eval()
        for i in range(rounds):
            real = i < len(mine)
            x, y = mine[i] if real else (torch.zeros(1, cfg.seq_len, dtype=torch.long),) * 2
            x, y = x.to(env.device), y.to(env.device)
            with self._autocast():
                logits = model(input_ids=x, use_cache=False).logits
            if real:
                total[0] += lm_loss(logits, y, reduction="sum").double()
                total[1] += y.numel()
        self.model.train()
        total = D.all_reduce_sum(total, env)
        return float(total[0] / total[1])

    def _clip(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor holding the global norm
            norm = norm.full_tensor()
        return float(norm)

    def _save(self, step: int, tokens: int, history: list[dict]) -> Path | None:
        env = self.env
        if self.cfg.checkpoint_format == "sharded":
            return self._save_sharded(step, tokens, history)
        model_sd = D.full_model_state_dict(self.model)  # collective under FSDP
        optim_sd = D.full_optimizer_state_dict(self.model, self.opt)
        rngs = D.gather_objects(ckpt_io.capture_rng(), env)
        path = None
        if env.is_main:
            state = {
                "step": step,
                "tokens_seen": tokens,
                "scheduler": self.sched.state_dict(),
                "data": self.batches.state_dict(),
                "rng": rngs,
                "history": history,
                "total_steps": self.total,
                "world_size": env.world_size,
            }
            path = ckpt_io.save_checkpoint(
                ckpt_io.checkpoint_root(self.out),
                step,
                model_sd,
                optim_sd,
                state,
                self.cfg.to_dict(),
                self.mc.to_dict(),
                keep=self.cfg.keep_checkpoints,
            )
        D.barrier(env)
        return path

    def _save_sharded(self, step: int, tokens: int, history: list[dict]) -> Path:
        """Every rank writes its shard in the background (dcp.py); returns the path it will have."""
        if self.sharded is None:  # collective (a process group for the checkpoint thread): all ranks at once
            self.sharded = dcp_io.ShardedCheckpointer(ckpt_io.checkpoint_root(self.out), self.env.rank,
                                                      self.env.world_size)
        state = {"step": step, "tokens_seen": tokens, "scheduler": self.sched.state_dict(), "history": history,
                 "total_steps": self.total, "world_size": self.env.world_size}
        mine = {"rng": ckpt_io.capture_rng(), "data": self.batches.state_dict()}
        return self.sharded.save(step, self.model, self.opt, state, mine, self.cfg.to_dict(), self.mc.to_dict(),
                                 keep=self.cfg.keep_checkpoints)

    def _train_step(self, step: int) -> tuple[float, float]:
        """One optimiser step over this rank's rows of the global batch: (mean loss, gradient norm)."""
        env, mb, accum = self.env, self.cfg.micro_batch_size, self.accum
        x_all, y_all = next(self.batches)
        loss_sum = torch.zeros((), device=env.device)
        for i in range(accum):
            x = x_all[i * mb : (i + 1) * mb].to(env.device, non_blocking=True)
            y = y_all[i * mb : (i + 1) * mb].to(env.device, non_blocking=True)
            with D.grad_sync(self.wrapped, env, sync=i == accum - 1):
                with self._autocast():
                    loss = (self.distiller or compute_loss)(self.wrapped, x, y)
                # Every micro-batch has the same number of tokens, so the mean of the micro-batch
                # means is the global-batch mean (DDP/FSDP average over ranks on top).
                (loss / accum).backward()
            loss_sum += loss.detach().float()
        loss_val = float(D.all_reduce_mean(loss_sum / accum, env))
        gnorm = self._clip()
        if not (math.isfinite(loss_val) and math.isfinite(gnorm)):
            # Before optimizer.step(): the weights are still the last good ones, but nothing is saved.
            last = ckpt_io.latest_checkpoint(ckpt_io.checkpoint_root(self.out))
            raise TrainingDiverged(
                f"training stopped at step {step + 1}: the loss is {loss_val} and the gradient norm {gnorm} "
                f"(not finite). Nothing was saved; the last good checkpoint {last if last else '(none)'} is "
                f"untouched. Try a lower lr (now {self.cfg.lr:g}), a longer warm-up, or check the data; "
                "--resume restarts from that checkpoint"
            )
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return loss_val, gnorm

    def _loop(self, step: int, tokens: int, history: list[dict], t_start: float) -> dict:
        cfg, env = self.cfg, self.env
        metrics = MetricsLogger(self.out, history, step, enabled=env.is_main)
        from tqdm.auto import tqdm

        self.pbar = tqdm(
            total=self.total,
            initial=step,
            unit="step",
            dynamic_ncols=True,
            disable=not self.verbose,
            desc=f"train {self.mc.kv_sharing}",
        )
        self.say(
            f"training {cfg.preset}/{self.mc.kv_sharing}: {self.total} steps x "
            f"{cfg.global_batch_tokens:,} tokens (accumulation {self.accum} x {cfg.micro_batch_size} x "
            f"{env.world_size} ranks), {'bf16 autocast' if self.use_bf16 else 'fp32'} on {env.device}, "
            f"out {self.out}"
        )
        sleep = float(os.environ.get(STEP_SLEEP_ENV, "0") or 0)
        train_time, session_tokens, stopped, last_saved = 0.0, 0, None, step
        if cfg.init_from and step == 0:
            # Where uptraining starts (a converted model before any step): the origin of the recovered gap.
            val = self.evaluate(cfg.final_eval_batches)
            self.say(f"step 0 (as initialised from {cfg.init_from}): val loss {val:.4f}")
            if env.is_main:
                write_json_atomic(self.out / INIT_EVAL, {"val_loss": val, "init_from": str(cfg.init_from)})
        try:
            with ckpt_io.StopSignals() as signals:
                while step < self.total:
                    t0 = time.perf_counter()
                    lr = self.opt.param_groups[0]["lr"]
                    loss, gnorm = self._train_step(step)
                    step += 1
                    tokens += cfg.global_batch_tokens
                    session_tokens += cfg.global_batch_tokens
                    dt = time.perf_counter() - t0
                    train_time += dt
                    row = {
                        "step": step,
                        "tokens": tokens,
                        "loss": loss,
                        "lr": lr,
                        "grad_norm": gnorm,
                        "tokens_per_s": cfg.global_batch_tokens / dt,
                        "elapsed_s": time.time() - t_start,
                    }
                    last = step == self.total
                    if last or (cfg.eval_every and step % cfg.eval_every == 0):
                        val = self.evaluate(cfg.final_eval_batches if last else cfg.eval_batches)
                        row.update(val_loss=val, val_ppl=math.exp(min(val, 50.0)))
                        self.say(f"step {step}: val loss {val:.4f} (ppl {row['val_ppl']:.2f})")
                    history.append(row)
                    metrics.log(row)
                    self.pbar.set_postfix(
                        loss=f"{loss:.3f}",
                        lr=f"{lr:.2e}",
                        tok_s=f"{session_tokens / train_time:,.0f}",
                        refresh=False,
                    )
                    self.pbar.update(1)
                    # A signal may reach one rank only; all ranks must agree to stop (and save) together.
                    stop = D.any_rank(signals.received is not None, env)
                    if stop or last or (cfg.ckpt_every and step % cfg.ckpt_every == 0):
                        self._save(step, tokens, history)
                        last_saved = step
                    if stop:
                        stopped = signals.received or "signal"
                        break
                    if sleep:
                        time.sleep(sleep)
        except BaseException:
            if self.sharded is not None:  # let the save in flight finish: it is a good checkpoint
                with contextlib.suppress(Exception):
                    self.sharded.close()
            raise
        finally:
            self.pbar.close()
            self.pbar = None
            metrics.close()
        if step == self.total and last_saved != step:  # resumed at the end: nothing trained, save anyway
            self._save(step, tokens, history)
        if self.sharded is not None:
            self.sharded.close()  # the last checkpoint is complete on disk before anything reads it
            self.sharded = None
        return self._finish(step, tokens, history, train_time, session_tokens, stopped, t_start)

    def _finish(self, step, tokens, history, train_time, session_tokens, stopped, t_start) -> dict:
        cfg, env, mc = self.cfg, self.env, self.mc
        val_loss = None
        if not stopped:
            if history and history[-1]["step"] == step and history[-1].get("val_loss") is not None:
                val_loss = history[-1]["val_loss"]
            else:
                val_loss = self.evaluate(cfg.final_eval_batches)
        elif any(r.get("val_loss") is not None for r in history):
            val_loss = [r["val_loss"] for r in history if r.get("val_loss") is not None][-1]
        final_dir = None if stopped else self._save_final()
        latest = ckpt_io.latest_checkpoint(ckpt_io.checkpoint_root(self.out))
        result = {
            "val_loss": val_loss,
            "val_ppl": math.exp(min(val_loss, 50.0)) if val_loss is not None else None,
            "train_loss": history[-1]["loss"] if history else None,
            "tokens_per_s": session_tokens / train_time if train_time else 0.0,
            "tokens_seen": tokens,
            "init_val_loss": _read_init_eval(self.out),
            "steps": step,
            "total_steps": self.total,
            "plan": mc.kv_sharing,
            "seed": cfg.seed,
            "num_params": sum(p.numel() for p in self.model.parameters()),
            **kv_cache_report(mc),
            "checkpoint": str(final_dir) if final_dir else None,
            "train_checkpoint": str(latest) if latest else None,
            "out_dir": str(self.out),
            "stopped": stopped,
            "wall_time_s": time.time() - t_start,
            "curve": [{k: r[k] for k in ("step", "tokens", "loss", "lr")} for r in history],
            "val_curve": [
                {"step": r["step"], "tokens": r["tokens"], "val_loss": r["val_loss"]}
                for r in history
                if r.get("val_loss") is not None
            ],
        }
        if env.is_main:
            title = f"{cfg.preset} {mc.kv_sharing} (seed {cfg.seed})"
            png = plot_learning_curves(history, self.out / "learning_curves.png", title)
            result["plot"] = str(png) if png else None
            (self.out / "summary.json").write_text(json.dumps(result, indent=1) + "\n")
            if stopped:
                self.say(
                    f"stopped by {stopped} after step {step}; checkpoint {latest}. Continue with: "
                    f"fusedkv train --out {self.out} --resume"
                )
            self.say(format_summary(result))
        return result

    def _last_good(self) -> str:
        return str(ckpt_io.latest_checkpoint(ckpt_io.checkpoint_root(self.out)) or "(none)")

    def _save_final(self) -> Path:
        """`save_pretrained` + tokenizer + integrity manifest into out_dir/final, atomically (temp dir,
        then rename)."""
        env = self.env
        sd = D.full_model_state_dict(self.model)  # collective under FSDP
        final = self.out / "final"
        if env.is_main:
            tmp = self.out / f".final.tmp-{os.getpid()}"
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                with _quiet_transformers(not self.verbose):
                    plain = FusedKVForCausalLM(self.mc)  # unwrapped, on CPU, whatever the training layout
                    plain.load_state_dict(sd, strict=True)
                    plain.save_pretrained(str(tmp))
                    with_chat_template(self.ds.load_tokenizer()).save_pretrained(str(tmp))  # chat requests work
                write_manifest(tmp)  # sizes + SHA-256, verified by from_pretrained (checkpoints.py)
                replace_dir(tmp, final)
            except Exception as e:
                reason = ckpt_io.write_failure(e, tmp / "model.safetensors")
                if reason is None:
                    raise
                where = getattr(e, "filename", None) or tmp
                raise RunError(
                    f"could not write the final model ({where}: {reason}); its temporary directory was removed. "
                    f"Training finished and the last good checkpoint is {self._last_good()}: free some space "
                    f"and run `fusedkv train --resume {self.out}` to write {final}"
                ) from e
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        D.barrier(env)
        return final


def kv_cache_report(mc: FusedKVConfig, bytes_per_element: int = 2) -> dict:
    """KV-cache bytes per token and for a full context, for this plan and for its baseline, MHA of the
    same shape (`FusedKVConfig.mha_kv_cache_bytes_per_token`; the "_vanilla" keys hold that baseline)."""
    mine = mc.kv_cache_bytes_per_token(bytes_per_element)
    vanilla = mc.mha_kv_cache_bytes_per_token(bytes_per_element)
    ctx = mc.max_position_embeddings
    return {
        "kv_cache_bytes_per_token": mine,
        "kv_cache_bytes_per_token_vanilla": vanilla,
        "kv_cache_ratio": mc.kv_cache_fraction(),
        "context_length": ctx,
        "kv_cache_bytes_full_context": mine * ctx,
        "kv_cache_bytes_full_context_vanilla": vanilla * ctx,
    }
