"""Steps 1-4 of a training run (`fusedkv.train.trainer`): from a TrainConfig to everything the loop needs.

1. Look at `out_dir`: pick and verify the checkpoint to resume (rundir.find_resume_checkpoint: the
   newest that verifies), or refuse to start over an existing run unless `overwrite`; check a resumed
   config against the saved one; a finished run has nothing to resume.
2. Build the model config (preset dims + plan, or `init_from`'s config with a new RoPE base/context).
3. Prepare the data (rank 0; a tokenizer of the model's vocab size) and the batch streams.
4. Build the model (seeded), load `init_from` weights, activation checkpointing, compile, DDP/FSDP2
   wrap, AdamW + warm-up/cosine schedule. Only now does `overwrite` remove the old run's files; then
   restore everything from the checkpoint when resuming (full: `full_checkpoint.load_checkpoint` +
   `distributed.load_full_state`; sharded: `sharded_checkpoint.load_into`, resharding to this layout).

Everything that can fail on bad input fails here, before anything in `out_dir` is written or deleted
(but the run directory's lock file).
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import FusedKVConfig
from ..data import TokenBatches
from ..errors import UsageError
from ..model import FusedKVForCausalLM
from ..model_dirs import check_checkpoint_dir
from . import data as data_setup
from . import distributed as D
from . import full_checkpoint as ckpt_io
from . import sharded_checkpoint as dcp_io
from .config import TrainConfig, normalise
from .distill import TEACHER_MODEL_TYPES, Distiller, check_teacher
from .freeze import freeze_lower_layers
from .optim import build_optimizer, build_scheduler
from .rundir import clear_previous_run, find_resume_checkpoint
from .teacher_cache import TeacherTopK, WindowBatches

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


def same_file(a, b) -> bool:
    """Two settings that name one file or directory however typed (relative to here, absolute, a link)."""
    return isinstance(a, str) and isinstance(b, str) and Path(a).exists() and Path(a).resolve() == Path(b).resolve()


@contextlib.contextmanager
def quiet_transformers(quiet: bool):
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

@dataclass
class Prepared:
    """What the training loop starts from (`RunSetup.prepare`)."""

    cfg: TrainConfig  # as the run uses it: values adopted from the checkpoint or init_from filled in
    mc: FusedKVConfig  # the model config (final: data-dependent token ids filled in)
    ds: object  # the prepared dataset (train/val token streams, tokenizer)
    batches: TokenBatches | WindowBatches  # this rank's stream of global-batch rows (its position is checkpointed)
    model: torch.nn.Module  # the plain FusedKVForCausalLM (FSDP2 shards it in place)
    wrapped: torch.nn.Module  # what the training step calls: DDP(model), or model itself
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    accum: int  # micro-batches per optimiser step on each rank
    total: int  # optimiser steps of the whole run
    distiller: Distiller | None  # when cfg.distill_from: the loss that replaces the trainer's compute_loss
    step: int  # where training starts (0, or the resumed checkpoint's step)
    tokens: int  # tokens seen so far
    history: list[dict]  # the learning curve so far


class RunSetup:
    """Steps 1-4 for one run; `say` / `warn` print as the trainer does (progress / always, rank 0)."""

    def __init__(self, cfg: TrainConfig, env: D.DistEnv, say: Callable[[str], None], warn: Callable[[str], None],
                 verbose: bool, use_bf16: bool):
        self.cfg, self.env = cfg, env
        self.out = Path(cfg.out_dir)
        self.say, self.warn = say, warn
        self.verbose, self.use_bf16 = verbose, use_bf16

    # ---- 1. out_dir and the checkpoint to resume ------------------------------------------------------
    def checkpoint_to_resume(self) -> Path | None:
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

    def check_finished(self, step: int, total: int) -> None:
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

    def check_resume_config(self, saved: dict) -> TrainConfig:
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
            if k not in RESUME_MAY_CHANGE and k in saved and saved[k] != mine[k] and not same_file(saved[k], mine[k])
        ]
        if diffs:
            raise ValueError(
                "cannot resume: the config differs from the checkpoint's in fields that define the "
                "run (" + "; ".join(diffs) + "). Resume with the original settings or start a new run"
            )
        return self.cfg.replace(**adopt) if adopt else self.cfg

    # ---- 2. model config ------------------------------------------------------------------------------
    def model_config(self, ckpt: dict | None) -> FusedKVConfig:
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
    def data(self, vocab_size: int):
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

    def prepare(self) -> Prepared:
        """Steps 1-4 of the module docstring: what the loop starts from."""
        cfg, env = self.cfg, self.env
        if cfg.distill_from is not None:  # a missing teacher fails before any data is prepared
            check_checkpoint_dir(cfg.distill_from, model_types=TEACHER_MODEL_TYPES)
        resume_path = self.checkpoint_to_resume()
        ckpt = None
        if resume_path is not None:  # a sharded checkpoint's tensors are read once the model is built
            load = dcp_io.read_checkpoint if dcp_io.is_sharded(resume_path) else ckpt_io.load_checkpoint
            ckpt = load(resume_path)
        if ckpt is not None:
            self.cfg = cfg = self.check_resume_config(ckpt["train_config"])
            self.check_finished(ckpt["step"], cfg.total_steps())
        if (
            ckpt is None
            and cfg.init_from is not None
            and cfg.tokenizer is None
            and data_setup.has_tokenizer(cfg.init_from)
        ):
            # Continued training must see text tokenised exactly as before.
            self.cfg = cfg = cfg.replace(tokenizer=str(cfg.init_from))
        mc = self.model_config(ckpt)
        if cfg.distill_from is not None:  # same vocabulary and tokenizer as the student, before any data is read
            tokenizer = check_teacher(cfg.distill_from, mc.vocab_size, cfg.tokenizer, cfg.data)
            self.cfg = cfg = cfg.replace(tokenizer=tokenizer)
        if cfg.kv_sharing is None or cfg.vocab_size is None:  # init_from: the checkpoint's
            self.cfg = cfg = cfg.replace(kv_sharing=mc.kv_sharing, vocab_size=mc.vocab_size)
        ds = self.data(mc.vocab_size)
        mc.eos_token_id = mc.bos_token_id = ds.eos_id
        if ckpt is None and cfg.init_from is None:
            mc.pad_token_id = ds.meta.get("pad_id")

        accum = cfg.grad_accum_steps(env.world_size)
        total = cfg.total_steps()
        # teacher_topk: windows on the teacher store's grid (fusedkv.train.teacher_cache), else random windows.
        batches = (WindowBatches if cfg.teacher_topk else TokenBatches)(
            ds.train,
            cfg.seq_len,
            accum * cfg.micro_batch_size,
            seed=cfg.seed,
            rank=env.rank,
            world_size=env.world_size,
        )

        model, wrapped, opt, sched = self.build(mc, ckpt)
        distiller = None  # replaces the trainer's compute_loss when distilling
        if cfg.distill_from is not None:
            store = None
            if cfg.teacher_topk:  # every rank opens the same store (filling a window is idempotent)
                store = TeacherTopK(Path(ds.out_dir) / "teacher", cfg.distill_from, ds.train.tokens, cfg.seq_len,
                                    cfg.teacher_topk, cfg.distill_temperature, mc.vocab_size)
                self.say(f"teacher top-{cfg.teacher_topk} store: {store.dir} ({store.count_filled()} of "
                         f"{store.num_windows} windows stored)")
            distiller = Distiller(cfg.distill_from, mc, env.device, cfg.distill_alpha, cfg.distill_temperature,
                                  cfg.distill_hidden_weight, store=store)
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
        return Prepared(cfg, mc, ds, batches, model, wrapped, opt, sched, accum, total, distiller, step, tokens,
                        history)

    def build(self, mc: FusedKVConfig, ckpt):
        cfg, env = self.cfg, self.env
        # Same seed on every rank: identical initial weights (FSDP shards them, DDP checks them).
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        with quiet_transformers(not self.verbose):
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
        if cfg.freeze_lower_layers:  # before the optimiser and the DDP/FSDP wrap: they see the trained set only
            split = freeze_lower_layers(model)
            self.say(f"frozen: the embedding and layers 1-{split} (they store K/V under the plan)")
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
