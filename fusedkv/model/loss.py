"""The language-model loss: next-token cross-entropy, written once for the whole package.

One label convention: `targets[..., t]` is the token that `logits[..., t, :]` must predict (what the
data loader yields: inputs `tokens[i : i+T]`, targets `tokens[i+1 : i+T+1]`), and `IGNORE_INDEX`
marks positions that do not count. transformers' convention (`labels` aligned with `input_ids`, the
shift done by the model) enters through `shift_labels`, at the two places that accept it:
`FusedKVForCausalLM.forward(labels=)` and `eval.perplexity.validation_loss`.

Users: the model's `forward(labels=)`, the trainer (training step and validation), perplexity and
validation loss in `fusedkv.eval`, and the gradient analysis (`fusedkv analyze grads`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of `logits` [..., V] against `targets` [...] (same leading shape), in fp32.

    reduction: "mean" over the counted positions (0, not NaN, when none counts: a window of context-only
    tokens under a loss mask), "sum", or "none" (per position; 0 where ignored)."""
    flat = targets.reshape(-1)
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), flat, ignore_index=IGNORE_INDEX,
                          reduction="sum" if reduction == "mean" else reduction)
    if reduction == "mean":
        return nll / (flat != IGNORE_INDEX).sum().clamp(min=1)
    return nll.view(targets.shape) if reduction == "none" else nll


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """transformers' labels (aligned with input_ids) -> targets: position t gets labels[t+1]; the last
    position, which has no next token, is ignored."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def causal_lm_loss(model, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The training objective: mean next-token cross-entropy, plus, for mixture-of-experts models, the
    load-balancing loss (returned by the model in training mode) times router_aux_loss_coef, as
    Qwen3-MoE does. `model` may be wrapped (DDP's `.module`)."""
    out = model(input_ids=input_ids, use_cache=False)
    loss = lm_loss(out.logits, targets)
    aux = getattr(out, "aux_loss", None)
    if aux is None:
        return loss
    return loss + getattr(model, "module", model).config.router_aux_loss_coef * aux
