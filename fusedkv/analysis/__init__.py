"""The paper's analyses as pictures: dense-fusion coefficient heat maps (Fig. 2) and per-layer
gradient norms of the Q/K/V projections (Fig. 9)."""

from .dense import dense_coefficients, plot_dense_heatmaps
from .gradients import plot_gradient_norms, record_gradient_norms

__all__ = ["dense_coefficients", "plot_dense_heatmaps", "plot_gradient_norms", "record_gradient_norms"]
