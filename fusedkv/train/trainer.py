"""`train(cfg)`: pre-train (or continue training) a FusedKV language model; the whole run in one call.

What a run does, in order (everything that can fail on bad input fails before anything is written):

0. Lock `out_dir` (rundir.RunDirLock, an OS lock held until the run ends): a second run there is
   refused at once, naming the holder.
1-4. Set up (`run_setup.RunSetup.prepare`, where each step is spelled out): the checkpoint to resume (or
   a refusal to start over an existing run), the model config, the data and batch streams, the model,
   its wrapping, optimiser and schedule; only then does `overwrite` remove the old run's files, and a
   resumed run gets its checkpoint's state back.
5. Train: gradient accumulation to the global batch, clipping, periodic validation, metrics to
   CSV/TensorBoard, checkpoints every `ckpt_every` steps and on SIGINT/SIGTERM. A non-finite loss
   or gradient stops the run with `TrainingDiverged` (exit 1) and leaves the last good checkpoint
   alone; a full disk stops it with a `RunError` naming the file and the last good checkpoint.
6. Final validation, `save_pretrained` model + tokenizer + integrity manifest into `out_dir/final/`,
   learning-curve PNG, `summary.json`, and the printed summary (loss/perplexity next to the KV cache).

Where each part lives: steps 1-4 in `run_setup` (`RunSetup.prepare`, which also restores a checkpoint),
the checkpoints and the final model in `run_checkpoints`, validation in `validation`, CSV / TensorBoard /
plots / the summary in `metrics`; this module holds the step, the loop and the result.

`train` is re-entrant (the experiment runner calls it for many plans and seeds in one process):
it restores signal handlers, destroys only process groups it created, and is silent when
`cfg.progress` is False. It returns the final metrics and the learning curve.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from ..errors import RunError, describe_os_error
from ..model.loss import causal_lm_loss
from ..utils import write_json_atomic
from . import distributed as D
from . import full_checkpoint as ckpt_io
from .config import TrainConfig
from .metrics import MetricsLogger, format_summary, kv_cache_report, plot_learning_curves
from .run_checkpoints import RunCheckpoints
from .run_setup import RunSetup
from .rundir import RunDirBusy, RunDirLock
from .validation import autocast, evaluate

__all__ = ["STEP_SLEEP_ENV", "TrainingDiverged", "compute_loss", "kv_cache_report", "train"]


# A run started from another model (--init-from) records its validation loss before the first step here.
INIT_EVAL = "init_eval.json"


def _read_init_eval(out: Path) -> float | None:
    path = out / INIT_EVAL
    return json.loads(path.read_text())["val_loss"] if path.is_file() else None


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



class _Run:
    """One training job: `run()` is setup (`run_setup`), the loop, and the result. `state` holds what the
    loop trains (None until set up)."""

    def __init__(self, cfg: TrainConfig, env: D.DistEnv):
        self.cfg, self.env = cfg, env
        self.out = Path(cfg.out_dir)
        self.verbose = cfg.progress and env.is_main
        self.pbar = None
        self.use_bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and env.device.type == "cuda")
        self.state = None  # run_setup.Prepared
        self.saver = None  # run_checkpoints.RunCheckpoints

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

    def evaluate(self, max_batches: int | None) -> float:
        return evaluate(self.state, self.env, self.use_bf16, max_batches)

    # ---- the run --------------------------------------------------------------------------------------
    def run(self) -> dict:
        t_start = time.time()
        self.state = s = RunSetup(self.cfg, self.env, self.say, self.warn, self.verbose, self.use_bf16).prepare()
        self.cfg = s.cfg
        self.saver = RunCheckpoints(s, self.env, self.verbose)
        try:
            return self._loop(s.step, s.tokens, s.history, t_start)
        except OSError as e:  # metrics, TensorBoard, summary: a full disk is a failure, not a traceback
            raise RunError(
                f"{describe_os_error(e)}; the last good checkpoint is {self.saver.last_good()}: free some space and "
                f"continue with `fusedkv train --resume {self.out}`"
            ) from e

    def _clip(self) -> float:
        params = [p for p in self.state.model.parameters() if p.grad is not None]
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor holding the global norm
            norm = norm.full_tensor()
        return float(norm)

    def _train_step(self, step: int) -> tuple[float, float]:
        """One optimiser step over this rank's rows of the global batch: (mean loss, gradient norm)."""
        env, mb, accum = self.env, self.cfg.micro_batch_size, self.state.accum
        x_all, y_all, *windows = next(self.state.batches)  # WindowBatches also says which stored windows
        loss_sum = torch.zeros((), device=env.device)
        for i in range(accum):
            x = x_all[i * mb : (i + 1) * mb].to(env.device, non_blocking=True)
            y = y_all[i * mb : (i + 1) * mb].to(env.device, non_blocking=True)
            extra = {"windows": windows[0][i * mb : (i + 1) * mb]} if windows else {}
            with D.grad_sync(self.state.wrapped, env, sync=i == accum - 1):
                with autocast(self.use_bf16, env.device):
                    loss = (self.state.distiller or compute_loss)(self.state.wrapped, x, y, **extra)
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
        self.state.opt.step()
        self.state.sched.step()
        self.state.opt.zero_grad(set_to_none=True)
        return loss_val, gnorm

    def _loop(self, step: int, tokens: int, history: list[dict], t_start: float) -> dict:
        cfg, env = self.cfg, self.env
        metrics = MetricsLogger(self.out, history, step, enabled=env.is_main)
        from tqdm.auto import tqdm

        self.pbar = tqdm(
            total=self.state.total,
            initial=step,
            unit="step",
            dynamic_ncols=True,
            disable=not self.verbose,
            desc=f"train {self.state.mc.kv_sharing}",
        )
        self.say(
            f"training {cfg.preset}/{self.state.mc.kv_sharing}: {self.state.total} steps x "
            f"{cfg.global_batch_tokens:,} tokens (accumulation {self.state.accum} x {cfg.micro_batch_size} x "
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
                while step < self.state.total:
                    t0 = time.perf_counter()
                    lr = self.state.opt.param_groups[0]["lr"]
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
                    last = step == self.state.total
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
                        self.saver.save(step, tokens, history)
                        last_saved = step
                    if stop:
                        stopped = signals.received or "signal"
                        break
                    if sleep:
                        time.sleep(sleep)
        except BaseException:
            self.saver.abandon()  # let a save in flight finish: it is a good checkpoint
            raise
        finally:
            self.pbar.close()
            self.pbar = None
            metrics.close()
        if step == self.state.total and last_saved != step:  # resumed at the end: nothing trained, save anyway
            self.saver.save(step, tokens, history)
        self.saver.close()  # the last checkpoint is complete on disk before anything reads it
        return self._finish(step, tokens, history, train_time, session_tokens, stopped, t_start)

    def _finish(self, step, tokens, history, train_time, session_tokens, stopped, t_start) -> dict:
        cfg, env, mc = self.cfg, self.env, self.state.mc
        val_loss = None
        if not stopped:
            if history and history[-1]["step"] == step and history[-1].get("val_loss") is not None:
                val_loss = history[-1]["val_loss"]
            else:
                val_loss = self.evaluate(cfg.final_eval_batches)
        elif any(r.get("val_loss") is not None for r in history):
            val_loss = [r["val_loss"] for r in history if r.get("val_loss") is not None][-1]
        final_dir = None if stopped else self.saver.save_final()
        latest = ckpt_io.latest_checkpoint(ckpt_io.checkpoint_root(self.out))
        result = {
            "val_loss": val_loss,
            "val_ppl": math.exp(min(val_loss, 50.0)) if val_loss is not None else None,
            "train_loss": history[-1]["loss"] if history else None,
            "tokens_per_s": session_tokens / train_time if train_time else 0.0,
            "tokens_seen": tokens,
            "init_val_loss": _read_init_eval(self.out),
            "steps": step,
            "total_steps": self.state.total,
            "plan": mc.kv_sharing,
            "seed": cfg.seed,
            "num_params": sum(p.numel() for p in self.state.model.parameters()),
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
            write_json_atomic(self.out / "summary.json", result)
            if stopped:
                self.say(
                    f"stopped by {stopped} after step {step}; checkpoint {latest}. Continue with: "
                    f"fusedkv train --out {self.out} --resume"
                )
            self.say(format_summary(result))
        return result
