"""The paper's optimiser: AdamW with selective weight decay, and warm-up + cosine learning rate.

Weight decay (0.1 in the paper) is applied only to 2-D weight matrices: the attention and MLP
projections, the token embedding and the LM head. It is *not* applied to

* RMSNorm weights and biases: the usual practice (decaying a gain toward 0 shrinks activations,
  it does not regularise capacity);
* fusion weights (`*.fusion.k_weight`, `*.fusion.v_weight`): they are per-channel gains of the
  same kind as norm weights. Each reconstruction layer's K/V are `a (.) K^1 + b (.) K^n`; decaying
  `a, b` pulls the reconstructed keys and values toward zero, i.e. toward attention over nothing,
  which no amount of other training can undo cheaply. Note their shape is 3-D
  `[sources, kv_heads, channels]`, so a rule based on `p.dim() >= 2` alone would wrongly decay them;
  the rule here goes by name first.

Schedule: linear warm-up from `peak / warmup` to the peak over `warmup_steps` steps, then cosine
decay to `min_lr_ratio * peak` at the last step (paper: 3e-4 -> 3e-5 after 2000 warm-up steps).
`lr_at` is a pure function of the step, so a resumed run sets exactly the same rates.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..model.fusion import KVFusion
from ..model.layers import RMSNorm


def no_decay_names(model: nn.Module) -> set[str]:
    """Names of the parameters that must not be weight-decayed (see the module docstring).

    Decided by the owning module's type (RMSNorm / LayerNorm, KVFusion), by name for biases, and
    by dimension as a fallback for any other vector or scalar."""
    out = set()
    for mod_name, module in model.named_modules():
        gain_like = (
            isinstance(module, (RMSNorm, KVFusion, nn.LayerNorm, nn.RMSNorm))
            or "norm" in type(module).__name__.lower()
        )
        for p_name, p in module.named_parameters(recurse=False):
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            if gain_like or p_name == "bias" or p.dim() < 2:
                out.add(name)
    return out


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: decayed 2-D matrices and everything else; each group also lists names."""
    skip = no_decay_names(model)
    decay, no_decay, decay_names, no_decay_list = [], [], [], []
    seen = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:  # tied parameters appear once
            continue
        seen.add(id(p))
        if name in skip:
            no_decay.append(p)
            no_decay_list.append(name)
        else:
            decay.append(p)
            decay_names.append(name)
    return [
        {"params": decay, "weight_decay": weight_decay, "names": decay_names},
        {"params": no_decay, "weight_decay": 0.0, "names": no_decay_list},
    ]


def paper_adamw(
    model: nn.Module, lr: float, weight_decay: float = 0.1, betas=(0.9, 0.95), eps: float = 1e-8
) -> torch.optim.AdamW:
    """The paper's AdamW with the decay groups above (defaults: the paper's betas and weight decay)."""
    groups = [{k: v for k, v in g.items() if k != "names"} for g in param_groups(model, weight_decay)]
    # foreach on CPU/CUDA is deterministic; the fused kernel is CUDA-only and differs in rounding.
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, foreach=True)


def build_optimizer(model: nn.Module, cfg) -> torch.optim.AdamW:
    """The training run's optimiser, from its TrainConfig."""
    return paper_adamw(model, cfg.lr, cfg.weight_decay, cfg.betas, cfg.eps)


def lr_at(step: int, peak: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning rate of optimiser step `step` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    floor = peak * min_lr_ratio
    decay_steps = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, max(0.0, (step - warmup_steps) / decay_steps))
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR around `lr_at` (so its state_dict is the standard one and the step is checkpointed)."""

    def factor(step: int) -> float:
        return lr_at(step, cfg.lr, cfg.warmup_steps, total_steps, cfg.min_lr_ratio) / cfg.lr

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
