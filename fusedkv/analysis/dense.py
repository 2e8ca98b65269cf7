"""Fig. 2: what an upper layer learns to read when it may fuse every lower layer.

A `fusedkv-dense` model gives each reconstruction layer one learnable scalar per lower (storage)
layer, separately for K and V. After training, the scalars form two matrices (rows: target layers,
columns: source layers) drawn side by side with a signed, zero-centred colour scale: the weights are
not probabilities and may be negative. The paper's finding is an asymmetry: keys lean on middle
layers, values on the first.
"""

from __future__ import annotations

import torch

from ..utils import save_figure


def dense_coefficients(model) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """(K matrix, V matrix, target layers, source layers), 1-based layer numbers, NaN where a target
    does not read a source."""
    plan = model.plan
    targets = [layer for layer in plan.layers if not layer.stores and layer.scalar_weighted]
    if not targets:
        raise ValueError("this model has no scalar-fusion layers; train one with --plan fusedkv-dense")
    sources = sorted({s for layer in targets for s in layer.k_sources + layer.v_sources})
    k = torch.full((len(targets), len(sources)), float("nan"))
    v = torch.full_like(k, float("nan"))
    for row, layer in enumerate(targets):
        fusion = model.model.layers[layer.index].self_attn.fusion
        for s, w in zip(layer.k_sources, fusion.k_weight.detach().float()):
            k[row, sources.index(s)] = w
        for s, w in zip(layer.v_sources, fusion.v_weight.detach().float()):
            v[row, sources.index(s)] = w
    return k, v, [t.index + 1 for t in targets], [s + 1 for s in sources]


def plot_dense_heatmaps(model, path, title: str = "Dense fusion coefficients") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k, v, targets, sources = dense_coefficients(model)
    bound = float(torch.nan_to_num(torch.stack([k, v]).abs(), nan=0.0).max()) or 1.0
    fig, axes = plt.subplots(1, 2, figsize=(4 + 1.1 * len(sources) * 2, 1.5 + 0.55 * len(targets)))
    for ax, mat, name in ((axes[0], k, "key weights"), (axes[1], v, "value weights")):
        im = ax.imshow(mat.numpy(), cmap="RdBu_r", vmin=-bound, vmax=bound, aspect="auto")
        ax.set_xticks(range(len(sources)), [str(s) for s in sources])
        ax.set_yticks(range(len(targets)), [str(t) for t in targets])
        ax.set_xlabel("source layer")
        ax.set_ylabel("target layer")
        ax.set_title(name)
        for i in range(mat.shape[0]):
            for j in range(mat.shape[1]):
                ax.text(j, i, f"{mat[i, j]:.2f}", ha="center", va="center", fontsize=7)
    fig.colorbar(im, ax=axes, shrink=0.8, label="coefficient (signed)")
    fig.suptitle(title, y=1.04)
    save_figure(fig, path, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return str(path)
