"""Freezing the lower layers for uptraining (`freeze_lower_layers`): train only what the conversion changed.

Converting a full-cache model to a sharing plan (paper Sec. 3) leaves every layer below the first
reconstruction layer exactly as it was: those layers store their own K/V under the plan, and the upper
layers read K^1, V^1, K^n, V^n from them (eq. 4-5). Only the upper layers see new inputs, so uptraining
can keep the lower ones, and the token embedding under them, at the teacher's weights:

* frozen: the token embedding (and with it a tied LM head: one tensor) and layers [0, split), where
  `split` is the first layer that reads another layer's K/V (the lower half under fusedkv and Lite);
* trained: layers [split, L) (their query / output projections, MLPs, norms and fusion weights), the
  final norm, and an untied LM head.

Nothing in the frozen part requires a gradient, so autograd records no graph for it: its forward keeps
no activations and its backward is never run. The source K/V the upper layers read are constants.
"""

from __future__ import annotations

from torch import nn

from ..errors import UsageError


def frozen_split(plan) -> int:
    """The first layer that reads another layer's K/V: every layer below it stores its own and is frozen."""
    for layer in plan.layers:
        if not layer.stores:
            return layer.index
    return len(plan.layers)


def freeze_lower_layers(model: nn.Module) -> int:
    """Freeze the embedding and the layers below `frozen_split` in place; returns the split. A plan in which
    every layer stores (vanilla, GQA) has no converted part to train apart from the rest: refused."""
    inner = model.model
    split = frozen_split(inner.plan)
    if split in (0, len(inner.layers)):
        raise UsageError(f"freeze_lower_layers: the plan {inner.config.kv_sharing!r} has no layers below a "
                         "reconstruction layer to freeze (every layer stores its own K/V, or the first does "
                         "not); use --set freeze_lower_layers=false")
    inner.embed_tokens.requires_grad_(False)
    for layer in inner.layers[:split]:
        layer.requires_grad_(False)
    return split


def frozen_names(model: nn.Module) -> list[str]:
    """The names of the parameters that do not train (tied ones under every name they have)."""
    return [n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad]
