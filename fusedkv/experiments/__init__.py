"""Experiments: train and evaluate sets of plans under one budget (`fusedkv compare`)."""

from .runner import load_experiment, plot_curves, run_experiment, summary_table

__all__ = ["load_experiment", "plot_curves", "run_experiment", "summary_table"]
