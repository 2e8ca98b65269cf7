"""Experiments: train and evaluate sets of plans under one budget (`fusedkv compare`)."""

from .report import paired_table, plot_curves, summary_table
from .runner import load_experiment, run_experiment

__all__ = ["load_experiment", "paired_table", "plot_curves", "run_experiment", "summary_table"]
