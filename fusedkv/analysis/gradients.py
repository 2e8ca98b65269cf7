"""Fig. 9: L2 norms of the gradients of the Q, K and V projections, per layer, during training.

The paper reads larger gradients in shallow layers as a sign that early layers' values are worth
reusing. `record_gradient_norms` trains a model for a few steps on real data with the training
recipe itself (the training loss of fusedkv/model/loss.py, the paper's AdamW with the trainer's decay
groups from fusedkv/train/optim.py: no decay on norms, biases and fusion weights, clipping at 1.0) and
records, after every backward pass, the gradient norm of each layer's q_proj, k_proj and v_proj
(reconstruction layers have no k_proj / v_proj: their entries are missing, not zero).
"""

from __future__ import annotations

import torch

from ..model.loss import causal_lm_loss
from ..train.optim import paper_adamw
from ..utils import save_figure


def record_gradient_norms(model, batches, steps: int, lr: float = 1e-3) -> dict[str, list[list[float]]]:
    """{"q"|"k"|"v": per step, per layer gradient L2 norm (NaN where the layer has no such projection)}."""
    model.train()
    opt = paper_adamw(model, lr)
    norms: dict[str, list[list[float]]] = {"q": [], "k": [], "v": []}
    for _, (inputs, targets) in zip(range(steps), batches):
        loss = causal_lm_loss(model, inputs, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for side in norms:
            row = []
            for layer in model.model.layers:
                proj = getattr(layer.self_attn, f"{side}_proj", None)
                row.append(float(proj.weight.grad.norm()) if proj is not None else float("nan"))
            norms[side].append(row)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.eval()
    return norms


def plot_gradient_norms(norms: dict[str, list[list[float]]], path, title: str = "Gradient L2 norms") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for side, marker in (("q", "o"), ("k", "s"), ("v", "^")):
        arr = np.array(norms[side])  # [steps, layers]; NaN columns: layers without this projection
        present = ~np.all(np.isnan(arr), axis=0)
        layers = np.arange(1, arr.shape[1] + 1)[present]
        axes[0].plot(layers, arr[:, present].mean(axis=0), marker=marker, label=f"{side}_proj")
    axes[0].set_xlabel("layer")
    axes[0].set_ylabel("mean gradient L2 norm")
    axes[0].set_yscale("log")
    axes[0].set_title("per layer (mean over steps)")
    axes[0].legend()
    axes[0].grid(alpha=0.3)
    arr = np.array(norms["v"])
    for i in range(arr.shape[1]):
        if not np.all(np.isnan(arr[:, i])):
            axes[1].plot(arr[:, i], label=f"layer {i + 1}")
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("v_proj gradient L2 norm")
    axes[1].set_yscale("log")
    axes[1].set_title("v_proj over training")
    axes[1].legend(fontsize=7, ncol=2)
    axes[1].grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
    return str(path)
