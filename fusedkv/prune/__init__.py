"""Weight pruning: Wanda (|W| * input-norm scores, per output row, unstructured or N:M), applied layer
by layer from calibration text (`fusedkv.prune.wanda`); `fusedkv prune` writes the result as a checkpoint."""

from .wanda import PrunedMatrix, calibration_batches, input_square_norms, prune_mask, wanda_prune, wanda_scores

__all__ = ["PrunedMatrix", "calibration_batches", "input_square_norms", "prune_mask", "wanda_prune", "wanda_scores"]
