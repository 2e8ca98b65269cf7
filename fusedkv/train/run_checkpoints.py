"""Saving a training run (`fusedkv.train.trainer`): checkpoints every `ckpt_every` steps, on a stop signal and
at the end, and the final model directory.

Full checkpoints gather the model and AdamW state onto rank 0, which writes them (`full_checkpoint`); sharded
ones are written by every rank, in the background (`sharded_checkpoint`). `out_dir/final/` is
`save_pretrained` + tokenizer + integrity manifest, renamed into place once complete. Reading them back
to resume is `run_setup`'s.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from ..data.tokenizer import with_chat_template
from ..errors import RunError
from ..model import FusedKVForCausalLM
from ..model_dirs import write_manifest
from ..utils import replace_dir
from . import distributed as D
from . import full_checkpoint as ckpt_io
from . import sharded_checkpoint as dcp_io
from .run_setup import Prepared, quiet_transformers


class RunCheckpoints:
    """The checkpoints and the final model of one run (`run`: what the loop trains)."""

    def __init__(self, run: Prepared, env: D.DistEnv, verbose: bool):
        self.run, self.env, self.verbose = run, env, verbose
        self.out = Path(run.cfg.out_dir)
        self.sharded = None  # sharded_checkpoint.ShardedCheckpointer, made at the first sharded save

    def close(self) -> None:
        """Wait for a sharded save in flight: the last checkpoint is complete on disk before anything reads it."""
        if self.sharded is not None:
            self.sharded.close()
            self.sharded = None

    def abandon(self) -> None:
        """On an error: let the save in flight finish (it is a good checkpoint), whatever else fails."""
        if self.sharded is not None:
            with contextlib.suppress(Exception):
                self.sharded.close()

    def save(self, step: int, tokens: int, history: list[dict]) -> Path | None:
        env = self.env
        if self.run.cfg.checkpoint_format == "sharded":
            return self.save_sharded(step, tokens, history)
        model_sd = D.full_model_state_dict(self.run.model)  # collective under FSDP
        optim_sd = D.full_optimizer_state_dict(self.run.model, self.run.opt)
        rngs = D.gather_objects(ckpt_io.capture_rng(), env)
        path = None
        if env.is_main:
            state = {
                "step": step,
                "tokens_seen": tokens,
                "scheduler": self.run.sched.state_dict(),
                "data": self.run.batches.state_dict(),
                "rng": rngs,
                "history": history,
                "total_steps": self.run.total,
                "world_size": env.world_size,
            }
            path = ckpt_io.save_checkpoint(
                ckpt_io.checkpoint_root(self.out),
                step,
                model_sd,
                optim_sd,
                state,
                self.run.cfg.to_dict(),
                self.run.mc.to_dict(),
                keep=self.run.cfg.keep_checkpoints,
            )
        D.barrier(env)
        return path

    def save_sharded(self, step: int, tokens: int, history: list[dict]) -> Path:
        """Every rank writes its shard in the background (sharded_checkpoint.py); returns the path it will have."""
        if self.sharded is None:  # collective (a process group for the checkpoint thread): all ranks at once
            self.sharded = dcp_io.ShardedCheckpointer(ckpt_io.checkpoint_root(self.out), self.env.rank,
                                                      self.env.world_size)
        state = {"step": step, "tokens_seen": tokens, "scheduler": self.run.sched.state_dict(), "history": history,
                 "total_steps": self.run.total, "world_size": self.env.world_size}
        mine = {"rng": ckpt_io.capture_rng(), "data": self.run.batches.state_dict()}
        return self.sharded.save(step, self.run.model, self.run.opt, state, mine, self.run.cfg.to_dict(),
                                 self.run.mc.to_dict(), keep=self.run.cfg.keep_checkpoints)

    def last_good(self) -> str:
        return str(ckpt_io.latest_checkpoint(ckpt_io.checkpoint_root(self.out)) or "(none)")

    def save_final(self) -> Path:
        """`save_pretrained` + tokenizer + integrity manifest into out_dir/final, atomically (temp dir,
        then rename)."""
        env = self.env
        sd = D.full_model_state_dict(self.run.model)  # collective under FSDP
        final = self.out / "final"
        if env.is_main:
            tmp = self.out / f".final.tmp-{os.getpid()}"
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                with quiet_transformers(not self.verbose):
                    plain = FusedKVForCausalLM(self.run.mc)  # unwrapped, on CPU, whatever the training layout
                    plain.load_state_dict(sd, strict=True)
                    plain.save_pretrained(str(tmp))
                    with_chat_template(self.run.ds.load_tokenizer()).save_pretrained(str(tmp))  # chat requests work
                write_manifest(tmp)  # sizes + SHA-256, verified by from_pretrained (fusedkv/model_dirs.py)
                replace_dir(tmp, final)
            except Exception as e:
                reason = ckpt_io.write_failure(e, tmp / "model.safetensors")
                if reason is None:
                    raise
                where = getattr(e, "filename", None) or tmp
                raise RunError(
                    f"could not write the final model ({where}: {reason}); its temporary directory was removed. "
                    f"Training finished and the last good checkpoint is {self.last_good()}: free some space "
                    f"and run `fusedkv train --resume {self.out}` to write {final}"
                ) from e
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        D.barrier(env)
        return final
