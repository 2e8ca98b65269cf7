"""The `fusedkv bench` command's library: inference speed and memory of the shipped engine per plan (TTFT, TPOT,
cache bytes; llama.cpp rows), the Triton kernel and paged-decode throughput, the GPU suite. Shipped and tested;
the stand-alone scripts that compare alternatives during development live in the repository's `benchmarks/`."""

from .inference import BenchShape, format_table, run_inference_bench

__all__ = ["BenchShape", "format_table", "run_inference_bench"]
