"""Sharded-checkpoint worker, run in-process by tests or under `torchrun` (gloo, CPU).

    dcp_worker.py save MODE CKPT_ROOT REF     train a nano model 2 steps under MODE (none/ddp/fsdp), save a
                                              sharded checkpoint asynchronously, take one more step while it
                                              is written, and put the state at save time in REF (rank 0)
    dcp_worker.py load MODE CKPT REF          load CKPT into a fresh model + AdamW under MODE and check every
                                              tensor equals REF exactly (exit 1 otherwise)
    dcp_worker.py hang MODE CKPT_ROOT         save with FUSEDKV_DCP_FINISH_SLEEP set, for a kill mid-save
    dcp_worker.py suite MODE CKPT REF ROOT_B REF_B   load CKPT under FSDP and DDP, `save MODE ROOT_B REF_B`,
                                              and load that checkpoint under DDP
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fusedkv import FusedKVConfig, FusedKVForCausalLM
from fusedkv.train import TrainConfig
from fusedkv.train import distributed as D
from fusedkv.train.full_checkpoint import capture_rng
from fusedkv.train.optim import build_optimizer
from fusedkv.train.sharded_checkpoint import ShardedCheckpointer, load_into

CFG = TrainConfig(preset="nano", data="builtin", progress=False)


def build(mode: str, seed: int):
    env = D.setup(mode, "cpu")
    torch.manual_seed(seed)
    mc = FusedKVConfig(vocab_size=CFG.vocab_size, kv_sharing="fusedkv", **CFG.model)
    model = FusedKVForCausalLM(mc).train()
    wrapped = D.wrap_model(model, env)
    return env, model, wrapped, build_optimizer(model, CFG)


def train_step(env, wrapped, opt, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, CFG.vocab_size, (2 * env.world_size, 32), generator=g)[2 * env.rank: 2 * env.rank + 2]
    wrapped(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def full_state(model, opt) -> dict:
    """A snapshot: the full state dicts share 0-dim tensors (AdamW's step) with the live optimizer."""
    return copy.deepcopy({"model": D.full_model_state_dict(model), "optim": D.full_optimizer_state_dict(model, opt)})


def save(mode: str, root: Path, ref: Path | None, steps: int = 2) -> Path:
    env, model, wrapped, opt = build(mode, seed=0)
    for s in range(steps):
        train_step(env, wrapped, opt, s)
    want = full_state(model, opt)
    ckpt = ShardedCheckpointer(root, env.rank, env.world_size, async_save=True)
    rank_state = {"rank": env.rank, "rng": capture_rng(), "data": {"step": steps}}
    path = ckpt.save(steps, model, opt, {"step": steps}, rank_state, {}, {})
    train_step(env, wrapped, opt, steps)  # changes the weights while the background thread writes
    ckpt.close()
    if env.rank == 0 and ref is not None:
        torch.save(want, ref)
    D.teardown(env)
    return path


def load(mode: str, path: Path, ref: Path) -> list[str]:
    env, model, wrapped, opt = build(mode, seed=123)  # other initial weights: all must come from the file
    load_into(path, model, opt)
    got = full_state(model, opt)
    bad = []
    if env.rank == 0:
        want = torch.load(ref, weights_only=True)
        for k, v in want["model"].items():
            if not torch.equal(got["model"][k], v):
                bad.append(f"model {k}")
        for name, st in want["optim"]["state"].items():
            for key, v in st.items():
                if not torch.equal(torch.as_tensor(got["optim"]["state"][name][key]), torch.as_tensor(v)):
                    bad.append(f"optim {name}.{key}")
        if [g["lr"] for g in got["optim"]["param_groups"]] != [g["lr"] for g in want["optim"]["param_groups"]]:
            bad.append("param_groups lr")
    D.teardown(env)
    return bad


def suite(mode: str, ckpt: Path, ref: Path, root_b: Path, ref_b: Path) -> None:
    """One launch: load a 1-process checkpoint under FSDP and DDP, save from `mode`, load that under DDP;
    exit 1 naming the tensors that differ."""
    bad = [f"fsdp: {b}" for b in load("fsdp", ckpt, ref)] + [f"ddp: {b}" for b in load("ddp", ckpt, ref)]
    if bad:
        print("MISMATCH " + ", ".join(bad[:10]), flush=True)
        sys.exit(1)
    path_b = save(mode, root_b, ref_b)
    dist.barrier()
    bad = [f"{mode} -> ddp: {b}" for b in load("ddp", path_b, ref_b)]  # DDP <-> FSDP, same world size
    if bad:
        print("MISMATCH " + ", ".join(bad[:10]), flush=True)
        sys.exit(1)


if __name__ == "__main__":
    torch.set_num_threads(1)
    action, mode, target = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    if mode != "none" and not dist.is_initialized():
        dist.init_process_group("gloo")
    if action == "save":
        save(mode, target, Path(sys.argv[4]))
    elif action == "hang":
        target.mkdir(parents=True, exist_ok=True)
        (target / f"pid-{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))
        save(mode, target, None)
    elif action == "suite":
        suite(mode, target, Path(sys.argv[4]), Path(sys.argv[5]), Path(sys.argv[6]))
    else:
        bad = load(mode, target, Path(sys.argv[4]))
        if bad:
            print("MISMATCH " + ", ".join(bad[:10]), flush=True)
            sys.exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()
