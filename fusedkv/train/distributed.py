"""Data-parallel training under `torchrun`: process groups, DDP / FSDP2 wrapping, full state dicts.

Launch with e.g. `torchrun --nproc_per_node=2 -m fusedkv.train.command --distributed fsdp`. torchrun
sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; `setup` reads them and initialises
the default process group (gloo on CPU, nccl on CUDA, one GPU per local rank).

* DDP: the whole model replicated, gradients all-reduced in backward (skipped with `no_sync` on
  all but the last micro-batch of a gradient-accumulation step).
* FSDP2: `fully_shard` on every decoder layer and then on the root (embeddings, final norm, LM
  head), over a 1-D device mesh. Parameters become DTensors sharded on dim 0; each layer's
  parameters are all-gathered just before its forward/backward and freed after. Reconstruction
  layers read the storage layers' K/V from the forward's `KVState`: those are activations, not
  parameters, so per-layer sharding needs nothing special for FusedKV.

Every rank takes its own rows of the global batch (`TokenBatches(rank=, world_size=)`), so for a
fixed global batch the trajectory is the same for any number of ranks (tests check 1 vs 2 ranks).

Saving gathers a *full* (unsharded) state dict onto rank 0's CPU with
`torch.distributed.checkpoint.state_dict` helpers; only rank 0 writes. Loading gives every rank the
full state dict (read from the shared output directory) and lets the helpers shard it again. The
same helpers are used without any process group, so checkpoints are interchangeable between
single-process, DDP and FSDP runs.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


@dataclass
class DistEnv:
    """Where this process sits: rank, world size, device, and whether we created the group."""

    mode: str = "none"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.mode != "none"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_device(pref: str, local_rank: int = 0) -> torch.device:
    if pref == "cuda" or (pref == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is available; use device=cpu (or auto)")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def setup(mode: str, device_pref: str = "auto") -> DistEnv:
    """Initialise the process group for `mode` in {"none", "ddp", "fsdp"}.

    Under torchrun the environment says rank and world size. Without it, ddp/fsdp still work as a
    one-process group (useful to test the wrapping); mode "none" never touches torch.distributed.
    """
    if mode == "none":
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError(
                f"launched with WORLD_SIZE={os.environ['WORLD_SIZE']} but distributed='none': every rank "
                "would train its own copy; pass --distributed ddp or --distributed fsdp"
            )
        return DistEnv(device=pick_device(device_pref))
    if "RANK" not in os.environ:  # not under torchrun: one process, said once (a test of the wrapping, or a slip)
        print(f"note: --distributed {mode} outside torchrun runs one process (world size 1); for N processes "
              f"launch with `torchrun --nproc_per_node=N -m fusedkv.cli ...`", file=sys.stderr, flush=True)
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_pref, local_rank)
    owns = False
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            rank=rank,
            world_size=world,
            device_id=device if device.type == "cuda" else None,
        )
        owns = True
    return DistEnv(
        mode=mode, rank=rank, world_size=world, local_rank=local_rank, device=device, owns_group=owns
    )


def teardown(env: DistEnv) -> None:
    if env.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def barrier(env: DistEnv) -> None:
    if env.enabled:
        dist.barrier()


def wrap_model(model: nn.Module, env: DistEnv, mixed_precision: torch.dtype | None = None) -> nn.Module:
    """DDP or FSDP2 around `model` (already on env.device). Returns the module to call in training."""
    if env.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
    if env.mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(env.device.type, (env.world_size,))
        # bf16 compute with fp32 gradient reduction on GPU; plain fp32 on CPU. Input casting is off:
        # the layers' inputs come out of bf16 computations anyway. The layers share the forward's
        # `KVState` (storage layers write K/V, reconstruction layers read it); it is an opaque object
        # to FSDP2's argument hooks, so every layer sees the same one.
        mp = (
            MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32,
                                 cast_forward_inputs=False)
            if mixed_precision
            else MixedPrecisionPolicy(cast_forward_inputs=False)
        )
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        return model
    return model


def grad_sync(wrapped: nn.Module, env: DistEnv, sync: bool):
    """Context for one micro-batch: skip the gradient all-reduce unless `sync` (last micro-batch)."""
    if env.mode == "ddp" and not sync:
        return wrapped.no_sync()
    if env.mode == "fsdp":
        # FSDP2 keeps unsharded gradients across micro-batches and reduce-scatters on the last.
        wrapped.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def all_reduce_mean(value: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.enabled and env.world_size > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= env.world_size
    return value


def all_reduce_sum(value: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.enabled and env.world_size > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def any_rank(flag: bool, env: DistEnv) -> bool:
    """True on every rank if `flag` is true on some rank (e.g. a signal reached only one process)."""
    if not (env.enabled and env.world_size > 1):
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def raise_if_failed(error: BaseException | None, env: DistEnv, what: str) -> None:
    """Collective: rank 0's `error` (if any) is raised on every rank, so no rank waits at a barrier for a
    rank that has already stopped. Other ranks get a ValueError that says `what` failed on rank 0."""
    if env.enabled and env.world_size > 1:
        box = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None and error is None:
            raise ValueError(f"rank 0 {what}: {box[0]}")
    if error is not None:
        raise error


def gather_objects(obj, env: DistEnv) -> list:
    """Every rank's `obj`, in rank order (used to checkpoint each rank's RNG state)."""
    if not (env.enabled and env.world_size > 1):
        return [obj]
    out = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


# ---- full state dicts ---------------------------------------------------------------------------------
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU state dict, keyed by the plain model's names (collective under FSDP: call on
    every rank; the result is complete on rank 0)."""
    return get_model_state_dict(model, options=_FULL)


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Unsharded optimizer state keyed by parameter names (portable between none/DDP/FSDP)."""
    return get_optimizer_state_dict(model, optimizer, options=_FULL)


def load_full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, model_sd: dict, optim_sd: dict | None
) -> None:
    """Load full state dicts on every rank; FSDP re-shards them to each rank's slice."""
    opts = StateDictOptions(full_state_dict=True, strict=True)
    set_model_state_dict(model, model_sd, options=opts)
    if optimizer is not None and optim_sd is not None:
        set_optimizer_state_dict(model, optimizer, optim_sd, options=opts)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain FusedKVForCausalLM under DDP (FSDP2 shards in place and keeps the module)."""
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model
