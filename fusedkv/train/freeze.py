"""Freezing the lower layers for uptraining (`freeze_lower_layers`): train only what the conversion changed.

Converting a full-cache model to a sharing plan (paper Sec. 3) leaves every layer below the first
reconstruction layer exactly as it was: those layers store their own K/V under the plan, and the upper
layers read K^1, V^1, K^n, V^n from them (eq. 4-5). Only the upper layers see new inputs, so uptraining
can keep the lower ones, and the token embedding under them, at the teacher's weights:

* frozen: the token embedding (and with it a tied LM head: one tensor) and layers [0, split), where
  `split` is the first layer that reads another layer's K/V (the lower half under fusedkv and Lite; 0
  under a plan where every layer stores, as a GQA conversion that pooled every layer's K/V heads);
* trained: layers [split, L) (their query / output projections, MLPs, norms and fusion weights), the
  final norm, and an untied LM head.

Nothing in the frozen part requires a gradient, so autograd records no graph for it: its forward keeps
no activations and its backward is never run. The source K/V the upper layers read are constants.
"""

from __future__ import annotations

from torch import nn


def frozen_split(plan) -> int:
    """The first layer that reads another layer's K/V: every layer below it stores its own and is frozen. A
    plan in which every layer stores gives 0: a model converted to it (GQA: every layer's K/V heads pooled)
    changed every layer, so only the embedding stays."""
    return next((layer.index for layer in plan.layers if not layer.stores), 0)


def freeze_lower_layers(model: nn.Module) -> int:
    """Freeze the embedding and the layers below `frozen_split` in place; returns the split."""
    inner = model.model
    split = frozen_split(inner.plan)
    inner.embed_tokens.requires_grad_(False)
    for layer in inner.layers[:split]:
        layer.requires_grad_(False)
    return split


def frozen_names(model: nn.Module) -> list[str]:
    """The names of the parameters that do not train (tied ones under every name they have)."""
    return [n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad]
