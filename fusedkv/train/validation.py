"""Validation during training: the loss per token on the validation split, every `eval_every` steps, at the
end, and (for a run started from another model) before the first step.

Ranks split the batches; under FSDP every rank runs the same number of forwards (they all-gather
parameters), so a rank with fewer batches runs a zero-weight dummy forward.
"""

from __future__ import annotations

import contextlib

import torch

from ..data import iter_eval_batches
from ..model.loss import lm_loss
from . import distributed as D
from .run_setup import Prepared


def autocast(use_bf16: bool, device: torch.device):
    """bf16 autocast for the training and validation forwards, or nothing (fp32)."""
    if use_bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(run: Prepared, env: D.DistEnv, use_bf16: bool, max_batches: int | None) -> float:
    """Mean validation loss per token over the first `max_batches` micro-batches of the val split (None: all)."""
    cfg = run.cfg
    model = run.wrapped if env.mode == "fsdp" else D.unwrap(run.wrapped)
    n_windows = (len(run.ds.val) - 1) // cfg.seq_len
    n_batches = -(-n_windows // cfg.micro_batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    mine = list(
        iter_eval_batches(
            run.ds.val,
            cfg.seq_len,
            cfg.micro_batch_size,
            max_batches=n_batches,
            rank=env.rank,
            world_size=env.world_size,
        )
    )
    rounds = -(-n_batches // env.world_size)
    total = torch.zeros(2, dtype=torch.float64, device=env.device)
    run.model.eval()
    for i in range(rounds):
        real = i < len(mine)
        x, y = mine[i] if real else (torch.zeros(1, cfg.seq_len, dtype=torch.long),) * 2
        x, y = x.to(env.device), y.to(env.device)
        with autocast(use_bf16, env.device):
            logits = model(input_ids=x, use_cache=False).logits
        if real:
            total[0] += lm_loss(logits, y, reduction="sum").double()
            total[1] += y.numel()
    run.model.train()
    total = D.all_reduce_sum(total, env)
    return float(total[0] / total[1])
