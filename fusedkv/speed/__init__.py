"""Benchmarks of inference speed and memory (`fusedkv bench`)."""

from .inference import BenchShape, format_table, run_inference_bench

__all__ = ["BenchShape", "format_table", "run_inference_bench"]
