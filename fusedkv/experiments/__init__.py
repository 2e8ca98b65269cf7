"""Experiments: train and evaluate sets of plans under one budget (`fusedkv compare`)."""

from .report import paired_table, plot_curves, summary_table
from .runner import run_experiment
from .spec import load_experiment

__all__ = ["load_experiment", "paired_table", "plot_curves", "run_experiment", "summary_table"]
