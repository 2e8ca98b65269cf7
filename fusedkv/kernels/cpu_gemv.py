"""Native weight products for CPU decoding (`cpu_gemv.c`): a few rows against a decode-layout weight.

A one-token decode step is a chain of matrix-vector products, so its time is the weight bytes divided
by how fast they are streamed. PyTorch's f32 product at one row (MKL) streams well below the memory's
rate and does not split one product across cores (`benchmarks/cpu_decode.py --kernels`; figures in
`docs/cpu-decode.md`). This kernel reads W^T ([in, out] row-major: the column-major weight of
`fusedkv.model.packing`'s decode layout) in long sequential runs and splits the output columns across
threads. f32 weights only: the reduced-precision formats keep PyTorch's kernels
(`fusedkv.model.precision`), which were faster than widening them in this loop. Built and loaded by
`fusedkv.kernels.native`.
"""

from __future__ import annotations

import torch

from . import native

# Up to this many input rows the native kernel runs (each extra row re-reads W^T from L1, not memory);
# above it PyTorch's GEMM is the faster (`benchmarks/cpu_decode.py --kernels`).
MAX_ROWS = 4


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` for a few rows, or None where this kernel does not apply (the caller
    then runs its own product): `weight` f32 [out, in] column-major (stride(0) == 1, as the decode layout
    stores it; a row slice of a packed buffer is fine), `x` f32 on CPU with at most `MAX_ROWS` rows, no
    autograd, not under torch.compile (which cannot trace a foreign call), `bias` f32 and contiguous."""
    if (weight.stride(0) != 1 or weight.dtype != torch.float32 or x.dtype != torch.float32
            or x.device.type != "cpu" or torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
            or torch.compiler.is_compiling() or not native.available()):
        return None
    out_features, in_features = weight.shape
    rows = x.numel() // in_features
    if rows > MAX_ROWS or rows == 0:
        return None
    x2 = x.reshape(rows, in_features)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    if bias is not None and (bias.dtype != torch.float32 or bias.stride(0) != 1):
        return None
    y = torch.empty(*x.shape[:-1], out_features)
    native.library().gemv_f32(x2.data_ptr(), rows, in_features, weight.data_ptr(), weight.stride(1),
                              None if bias is None else bias.data_ptr(), y.data_ptr(), out_features,
                              torch.get_num_threads())
    return y
