"""Sharded training checkpoints with `torch.distributed.checkpoint` (DCP): every rank writes its own shard.

The full checkpoints of `full_checkpoint.py` gather the whole model and AdamW state onto rank 0, which
writes them alone: at 4B parameters that is ~64 GB through one process. Here, as in torchtitan, each
rank writes the part of the state it holds, in parallel, and in the background:

    checkpoints/step-NNNNNNNN/
      dcp/.metadata, dcp/__R_0.distcp   model + optimizer, one file per rank (DCP's format): FSDP2
                                        shards as they are; DDP's replicated tensors deduplicated
                                        across ranks, so each rank writes about 1/N of them
      rank-RRRRR.pt                     each rank's RNG states and data-loader position
      trainer_state.pt                  step, tokens, LR schedule, learning curve (rank 0)
      train_config.json, model_config.json
      manifest.json                     written last: size + SHA-256 of every file above

Model and optimizer state come from `torch.distributed.checkpoint.state_dict.get_state_dict`: keys are
the plain model's parameter names whatever the wrapping (none, DDP, FSDP2), and tensors are DTensor
shards under FSDP2. DCP records each tensor's global shape and which chunk each rank wrote, so a
checkpoint saved by N processes loads into M processes, under DDP or FSDP2 (resharding on resume):
`load_into` asks the *new* layout for its state-dict template and DCP reads the chunks it needs.

Atomicity and integrity are the same as for full checkpoints: everything is written into a hidden
`.tmp-step-NNNNNNNN-sharded/` directory; once every rank has written (DCP's own collective) and
fsynced its files, each rank hashes its files, rank 0 gathers the hashes, writes `manifest.json`,
fsyncs and renames the directory to its final name. A save killed at any moment leaves only the
temporary directory (ignored, and removed by the next run); `checkpoint.verify_checkpoint` checks the
manifest exactly as for a full checkpoint. The directory must be on a filesystem every rank sees.

Asynchronous save: `dcp.async_save` copies ("stages") the state to CPU memory before it returns, so
training can go on changing the weights; the writing, hashing, manifest and rename run in a
background thread. Its collectives go through a gloo process group of their own, so they never
interleave with the training loop's all-reduces. At most one save is in flight: the next save (and
the end of the run) waits for the previous one.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ..utils import replace_dir
from . import full_checkpoint as ckpt_io

LAYOUT = "sharded"
DCP_DIR = "dcp"
# Seconds the background save sleeps after writing the shards and before the manifest: lets tests
# kill a process in the middle of a save. It changes nothing else.
FINISH_SLEEP_ENV = "FUSEDKV_DCP_FINISH_SLEEP"


# A single-process run saves and loads without a process group on purpose: DCP's warning about it says
# nothing to the user (the save runs in a background thread, so a scoped catch_warnings would not do).
warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def is_sharded(path: str | Path) -> bool:
    """True if `path` is a sharded (DCP) checkpoint directory, complete or not."""
    path = Path(path)
    mpath = path / "manifest.json"
    if mpath.is_file():
        try:
            return json.loads(mpath.read_text()).get("layout") == LAYOUT
        except (json.JSONDecodeError, AttributeError):
            return False
    return (path / DCP_DIR).is_dir()


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


class ShardedCheckpointer:
    """Saves sharded checkpoints for one run; construct it on every rank at the same point (it creates
    a process group when torch.distributed is initialised)."""

    def __init__(self, root: str | Path, rank: int = 0, world_size: int = 1, async_save: bool = True):
        self.root = Path(root)
        self.rank, self.world_size = rank, world_size
        self.async_save = async_save
        # Checkpoint collectives get their own gloo group: the background thread's gathers must not
        # interleave with the training loop's collectives on the default group.
        self.group = dist.new_group(backend="gloo") if _dist_on() else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fusedkv-dcp")
        self._pending: Future | None = None
        self.last_path: Path | None = None
        self.last_timing: dict = {}

    # ---- saving ---------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict,
        rank_state: dict,
        train_config: dict,
        model_config: dict,
        keep: int = 2,
    ) -> Path:
        """Start saving `step` (collective: call on every rank). Returns the final path, which exists
        once the save completes (`wait`). `trainer_state` is used on rank 0; `rank_state` (RNG, data
        position) is this rank's own."""
        self.wait()
        t0 = time.perf_counter()
        final = self.root / ckpt_io.step_dir_name(step)
        tmp = self.root / f".tmp-{final.name}-{LAYOUT}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / DCP_DIR).mkdir(parents=True)
        self._barrier()
        torch.save(rank_state, tmp / rank_file(self.rank))
        if self.rank == 0:
            torch.save(trainer_state, tmp / "trainer_state.pt")
            (tmp / "train_config.json").write_text(json.dumps(train_config, indent=2, sort_keys=True) + "\n")
            (tmp / "model_config.json").write_text(json.dumps(model_config, indent=2, sort_keys=True) + "\n")
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        writer = dcp.FileSystemWriter(str(tmp / DCP_DIR), single_file_per_rank=True, sync_files=True)
        if self.async_save:
            # Returns once the state is staged (copied to CPU memory); the writing goes on in a thread.
            future = dcp.async_save(state, storage_writer=writer, process_group=self.group)
        else:
            dcp.save(state, storage_writer=writer, process_group=self.group)
            future = None
        self.last_timing = {"blocked_s": time.perf_counter() - t0}
        job = self._pool.submit(self._finish, future, tmp, final, step, keep, t0)
        self._pending = job
        if not self.async_save:
            self.wait()
        return final

    def _finish(self, future: Future | None, tmp: Path, final: Path, step: int, keep: int, t0: float) -> Path:
        if future is not None:
            future.result()
        sleep = float(os.environ.get(FINISH_SLEEP_ENV, "0") or 0)
        if sleep:
            time.sleep(sleep)
        mine = {}
        for name in self._my_files(tmp):
            path = tmp / name
            with path.open("rb+") as f:
                os.fsync(f.fileno())
            mine[name] = {"bytes": path.stat().st_size, "sha256": ckpt_io._sha256(path)}
        everyone = [None] * self.world_size if self.rank == 0 else None
        if self.group is not None:
            dist.gather_object(mine, everyone, dst=0, group=self.group)
        else:
            everyone = [mine]
        if self.rank == 0:
            files = {}
            for part in everyone:
                files.update(part)
            manifest = {"format": ckpt_io.FORMAT_VERSION, "layout": LAYOUT, "step": step,
                        "world_size": self.world_size, "files": dict(sorted(files.items()))}
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
            with (tmp / "manifest.json").open("rb+") as f:
                os.fsync(f.fileno())
            ckpt_io._fsync_dir(tmp / DCP_DIR)
            ckpt_io._fsync_dir(tmp)
            replace_dir(tmp, final)  # also when the same step is saved again (signalled right after a resume)
            ckpt_io._fsync_dir(self.root)
            for old in ckpt_io.list_checkpoints(self.root)[:-keep]:
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)
        if self.group is not None:
            dist.barrier(group=self.group)  # every rank returns once the checkpoint is in place
        self.last_path = final
        self.last_timing["total_s"] = time.perf_counter() - t0
        return final

    def _my_files(self, tmp: Path) -> list[str]:
        """Files this rank wrote (and so hashes): its DCP shard files and rank file; rank 0 also the
        DCP metadata and the run-wide files."""
        names = [rank_file(self.rank)]
        names += [f"{DCP_DIR}/{p.name}" for p in sorted((tmp / DCP_DIR).iterdir())
                  if p.name.startswith(f"__{self.rank}_")]
        if self.rank == 0:
            names += [f"{DCP_DIR}/.metadata", "trainer_state.pt", "train_config.json", "model_config.json"]
        return names

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def wait(self) -> Path | None:
        """Block until the save in flight (if any) is complete on every rank; re-raise its error."""
        job, self._pending = self._pending, None
        return job.result() if job is not None else None

    def close(self, wait: bool = True) -> None:
        try:
            if wait:
                self.wait()
        finally:
            self._pool.shutdown(wait=wait, cancel_futures=True)
            if self.group is not None and wait:
                dist.destroy_process_group(self.group)
                self.group = None


# ---- loading ------------------------------------------------------------------------------------------
def read_checkpoint(path: str | Path) -> dict:
    """Verify a sharded checkpoint and read everything but the model and optimizer tensors, in the same
    shape as `checkpoint.load_checkpoint` (model/optimizer are None; `trainer_state["rng"]` lists every
    saved rank's RNG states). `load_into` then fills the model and optimizer."""
    path = Path(path)
    manifest = ckpt_io.verify_checkpoint(path)
    if manifest.get("layout") != LAYOUT:
        raise ValueError(f"checkpoint {path} is not a sharded (DCP) checkpoint")
    try:
        ts = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True)
        ranks = [torch.load(path / rank_file(r), map_location="cpu", weights_only=True)
                 for r in range(int(manifest["world_size"]))]
        ts["rng"] = [r["rng"] for r in ranks]
        ts["data"] = ranks[0]["data"]
        return {
            "path": path,
            "step": int(manifest["step"]),
            "sharded": True,
            "model": None,
            "optimizer": None,
            "trainer_state": ts,
            "rank_states": ranks,
            "train_config": json.loads((path / "train_config.json").read_text()),
            "model_config": json.loads((path / "model_config.json").read_text()),
        }
    except Exception as e:  # a file that hashes right but does not parse: written by something else
        raise ValueError(f"checkpoint {path} could not be read ({type(e).__name__}: {e})") from e


def load_into(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Load a sharded checkpoint's model (and optimizer) state into `model` as it is wrapped now
    (collective under DDP/FSDP: call on every rank). Any saved world size and layout works."""
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    else:
        state = {"model": get_model_state_dict(model)}
    try:
        dcp.load(state, checkpoint_id=str(Path(path) / DCP_DIR))
    except dcp.CheckpointException as e:
        raise ValueError(f"checkpoint {path}: the saved tensors do not fit this model ({e})") from e
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        set_model_state_dict(model, state["model"])
