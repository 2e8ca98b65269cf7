"""Calibrated conversion (`--fusion-init calibrated`, beyond the paper, which trains from scratch): a converted
model's reconstruction layers fitted in closed form to the original model on calibration text, so that it
starts close to the original instead of from the paper's initialisation (App. A.3).

  fit.py      the least-squares fits: fusion weights per (KV head, channel or RoPE pair), source choice by
              residual, ridge refit of a linear layer (float64 normal equations, accumulated batch by batch)
  passes.py   the passes over calibration text: the fusion fit (streamed), the layer-by-layer refits
  convert.py  `convert_calibrated`: import, calibrate, write atomically with `calibration.json`
"""

from .convert import REPORT, SOURCE_CHOICES, Calibration, calibration_batches, convert_calibrated
from .fit import FusionStats, RidgeStats, fusion_parameter
from .passes import REFIT_STAGES, LayerFit, fit_fusion, refit_layers, set_fusion, source_map

__all__ = ["REFIT_STAGES", "REPORT", "SOURCE_CHOICES", "Calibration", "FusionStats", "LayerFit", "RidgeStats",
           "calibration_batches", "convert_calibrated", "fit_fusion", "fusion_parameter", "refit_layers",
           "set_fusion", "source_map"]
