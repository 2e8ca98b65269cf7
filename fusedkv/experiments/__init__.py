"""Experiments: train and evaluate sets of plans under one budget (`fusedkv compare`)."""

from .runner import load_experiment, paired_table, plot_curves, run_experiment, summary_table

__all__ = ["load_experiment", "paired_table", "plot_curves", "run_experiment", "summary_table"]
