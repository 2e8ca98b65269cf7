"""Native weight products for CPU decoding (`cpu_gemv.c`): a few rows against a decode-layout weight.

A one-token decode step is a chain of matrix-vector products, so its time is the weight bytes divided
by how fast they are streamed. PyTorch's f32 product at one row (MKL) streams well below the memory's
rate and does not split one product across cores (`benchmarks/cpu_decode.py --kernels`; figures in
`docs/cpu-decode.md`). This kernel reads W^T ([in, out] row-major: the column-major weight of
`fusedkv.engine.packing`'s decode layout) in long sequential runs and splits the output columns across
threads. f32 weights there; f16 keeps PyTorch's kernels (`fusedkv.engine.precision`), which were faster
than widening it in that loop. bf16 and int8 weights get `linear_blocks`, over the weight stored in blocks
of 16 outputs with their input channels in pairs (`to_blocks`: one contiguous run per block, read in order):
with AVX-512 BF16, pairs of bf16 weights times pairs of bf16 inputs in one instruction (int8 widened to bf16
in registers, exactly); with AVX2, each pair-row widened to f32 in registers (exactly) for f32 FMAs; f32
accumulation either way, int8 scaled per output. f16 weights in the same blocks are converted to f32 in
registers (F16C) wherever AVX2 is, and multiply f32 inputs as given. int4 weights (`linear_int4`) use the
same blocks with nibbles. `blocks_isa` says which build runs. Built and loaded by `fusedkv.kernels.native`.
"""

from __future__ import annotations

import torch

from . import native

# Up to this many input rows the native f32 kernel runs (each extra row re-reads W^T from L1, not memory);
# above it PyTorch's GEMM is the faster (`benchmarks/cpu_decode.py --kernels`).
MAX_ROWS = 4
# The block kernels (bf16 / int8) take rows 4 at a time over a block that stays in cache: up to this many
# they beat re-laying the weight out for oneDNN's GEMM (the same table).
BLOCK_MAX_ROWS = 16


def _rows(x: torch.Tensor, in_features: int, bias: torch.Tensor | None, max_rows: int = MAX_ROWS) -> int:
    """How many rows a native product over `x` computes, or 0 where it does not run: `x` f32 on CPU with
    1 to `max_rows` rows, no autograd, not under torch.compile (which cannot trace a foreign call), `bias`
    f32 and contiguous. These checks run on every product of a decode step: cheapest first."""
    if (x.dtype is not torch.float32 or not x.is_cpu or torch.is_grad_enabled() and x.requires_grad
            or bias is not None and (bias.dtype is not torch.float32 or bias.stride(0) != 1)
            or torch.compiler.is_compiling()):
        return 0
    rows = x.numel() // in_features
    return rows if rows <= max_rows else 0


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` for a few rows (`_rows`), or None where this kernel does not apply (the
    caller then runs its own product): `weight` f32 [out, in] column-major (stride(0) == 1, as the decode
    layout stores it; a row slice of a packed buffer is fine) and not requiring a gradient."""
    if weight.stride(0) != 1 or weight.dtype is not torch.float32 or torch.is_grad_enabled() and weight.requires_grad:
        return None
    out_features, in_features = weight.shape
    rows = _rows(x, in_features, bias)
    lib = native.library() if rows else None
    if lib is None:
        return None
    x2 = x.reshape(rows, in_features).contiguous()
    y = x2.new_empty((*x.shape[:-1], out_features))
    lib.gemv_f32(x2.data_ptr(), rows, in_features, weight.data_ptr(), weight.stride(1),
                 None if bias is None else bias.data_ptr(), y.data_ptr(), out_features, torch.get_num_threads())
    return y


BLOCK = 16  # outputs per block of the bf16 / int8 layout (one AVX-512 register of f32 accumulators, two of AVX2)
# a pair of input channels as one element
_PAIR_UNIT = {torch.bfloat16: torch.int32, torch.float16: torch.int32, torch.int8: torch.int16}


def blocks_isa() -> str | None:
    """How the block products run here: "avx512-bf16" (bf16 dot products), "avx2" (the weights widened to f32 in
    registers, f32 FMAs), or None (native kernels not built, or built for neither)."""
    return getattr(native.library(), "blocks_isa", None)


def blocks_available() -> bool:
    """The bf16 / int8 block kernels run here (`blocks_isa`)."""
    return blocks_isa() is not None


def f16_blocks_available() -> bool:
    """The f16 block kernel runs here (a processor with AVX2, FMA and F16C)."""
    lib = native.library()
    return lib is not None and lib.f16_blocks


def to_blocks(weight: torch.Tensor) -> torch.Tensor | None:
    """[out, in] weight -> [out / 16, ceil(in / 2), 16, 2] in its own dtype: blocks of 16 outputs, each
    holding its input channels in pairs (an odd last channel is paired with a zero); None when out is not
    a multiple of 16 (the caller keeps its own layout). bf16 weights, or int8 ones from
    `fusedkv.engine.precision.quantize_int8`, are what the kernels read."""
    out_features, in_features = weight.shape
    if out_features % BLOCK:
        return None
    w = weight.detach()
    if in_features % 2:
        w = torch.cat([w, w.new_zeros(out_features, 1)], dim=1)
    return w.reshape(out_features // BLOCK, BLOCK, -1, 2).transpose(1, 2).contiguous()


def to_bf16_blocks(weight: torch.Tensor) -> torch.Tensor | None:
    """`to_blocks` of the weight rounded to bf16."""
    return to_blocks(weight.detach().float().to(torch.bfloat16))


def from_blocks(blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """The inverse of `to_blocks` (a copy): [out, in], row-major, in the blocks' dtype."""
    n, pairs = blocks.shape[:2]
    # Move pairs as single units (a pair of input channels stays adjacent in [out, in]): ~4x faster than
    # transposing the elements one by one, which matters because prefill does this per product.
    unit = _PAIR_UNIT[blocks.dtype]
    rows = blocks.contiguous().view(unit).transpose(1, 2).contiguous().view(blocks.dtype)
    w = rows.reshape(n * BLOCK, 2 * pairs)
    return w if w.shape[1] == in_features else w[:, :in_features].contiguous()


def linear_blocks(x: torch.Tensor, blocks: torch.Tensor, in_features: int, scale: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """`F.linear(x.bfloat16(), W)` in f32 for a few rows, W given by `to_blocks` in bf16, or in int8 with
    its f32 per-output `scale` (W = scale (.) q); `blocks` may be a slice `blocks[a:b]` (with the matching
    slice of `scale`). x is rounded to bf16, as PyTorch's bf16 GEMV rounds it. f16 blocks: `F.linear(x, W)`
    with x in f32 as given. None where it does not apply (no block kernels here, more than `BLOCK_MAX_ROWS`
    rows, autograd, not f32 on CPU)."""
    rows = _rows(x, in_features, bias, BLOCK_MAX_ROWS)
    if not rows or blocks.shape[0] == 0 or not blocks[0].is_contiguous():
        return None
    if blocks.dtype == torch.float16:  # f32 inputs as they are
        if not f16_blocks_available():
            return None
        x2 = x.reshape(rows, in_features).contiguous()
        y = torch.empty(*x.shape[:-1], blocks.shape[0] * BLOCK)
        native.library().gemv_f16_blocks(x2.data_ptr(), rows, in_features, blocks.data_ptr(), blocks.stride(0),
                                         None if bias is None else bias.data_ptr(), y.data_ptr(), y.shape[-1],
                                         torch.get_num_threads())
        return y
    if not blocks_available():
        return None
    int8 = blocks.dtype == torch.int8
    if int8 and (scale is None or scale.dtype is not torch.float32 or not scale.is_contiguous()):
        return None
    padded = 2 * blocks.shape[1]
    xb = x.reshape(rows, in_features).to(torch.bfloat16)
    if padded != in_features:
        xb = torch.cat([xb, xb.new_zeros(rows, padded - in_features)], dim=1)
    xb = xb.contiguous()
    out_features = blocks.shape[0] * BLOCK
    y = torch.empty(*x.shape[:-1], out_features)
    lib = native.library()
    kernel = lib.gemv_int8_blocks if int8 else lib.gemv_bf16_blocks
    kernel(xb.data_ptr(), rows, padded, blocks.data_ptr(), blocks.stride(0), scale.data_ptr() if int8 else None,
           None if bias is None else bias.data_ptr(), y.data_ptr(), out_features, torch.get_num_threads())
    return y


GROUP = 32  # input channels per int4 scale (llama.cpp's Q4_0 block)


def to_int4_blocks(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 levels q [out, in] (int8 holding -8..7) and f16 group scales [out, ceil(in / 32)] -> the layout of
    `gemv_int4_blocks`: (uint8 [ceil(out / 16), groups, 8, 32], f16 [ceil(out / 16), groups, 16]). The 16
    pair-rows of a group (the 32 elements each of the bf16 block layout, `to_blocks`) are stored as nibbles
    q + 8, two pair-rows per 32 bytes: byte k = element k of pair 2c | element k of pair 2c + 1 << 4. Inputs
    are padded to whole groups and outputs to whole blocks with zeros."""
    out_features, in_features = q.shape
    groups, blocks = -(-in_features // GROUP), -(-out_features // BLOCK)
    levels = torch.zeros(blocks * BLOCK, groups * GROUP, dtype=torch.int16)
    levels[:out_features, :in_features] = q
    scales = torch.zeros(blocks * BLOCK, groups, dtype=torch.float16)
    scales[:out_features] = scale
    # [out, in] -> [blocks, groups, 8 pair couples, 2 pairs, 16 outputs, 2]: the bf16 pair order within a group
    e = (levels + 8).reshape(blocks, BLOCK, groups, GROUP // 4, 2, 2).permute(0, 2, 3, 4, 1, 5)
    e = e.reshape(blocks, groups, GROUP // 4, 2, 32)
    packed = (e[:, :, :, 0] | (e[:, :, :, 1] << 4)).to(torch.uint8)
    return packed.contiguous(), scales.reshape(blocks, BLOCK, groups).transpose(1, 2).contiguous()


def from_int4_blocks(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `to_int4_blocks`, padding kept: (int8 levels [16 blocks, 32 groups], f16 scales
    [16 blocks, groups])."""
    blocks, groups = packed.shape[:2]
    # in bytes throughout (prefill runs this for every product): nibbles, then one permuting copy
    e = torch.stack([packed & 15, packed >> 4], dim=3)  # [blocks, groups, 8, 2 pairs, 32 elements], q + 8
    q = e.reshape(blocks, groups, GROUP // 4, 2, BLOCK, 2).permute(0, 4, 1, 2, 3, 5)
    q = q.reshape(blocks * BLOCK, groups * GROUP).view(torch.int8) - 8
    return q, scales.transpose(1, 2).reshape(-1, groups)


def linear_int4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, in_features: int,
                bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """`x_bf16 W^T` in f32 for a few rows, W = scale (.) q from `to_int4_blocks` (all its padded outputs,
    16 per block; `packed` / `scales` may be the same slice of blocks). None where it does not apply (native
    kernels not built, more than `BLOCK_MAX_ROWS` rows, autograd, not f32 on CPU). Any processor the kernels
    build for: AVX-512 BF16 dot products where present, AVX2 byte look-ups and f32 FMAs, else a portable loop."""
    rows = _rows(x, in_features, bias, BLOCK_MAX_ROWS)
    lib = native.library() if rows and packed.shape[0] else None
    # the kernel steps through the scales block by block, groups * 16 apart
    if (lib is None or not packed[0].is_contiguous() or not scales[0].is_contiguous()
            or scales.shape[0] > 1 and scales.stride(0) != packed.shape[1] * BLOCK):
        return None
    padded = packed.shape[1] * GROUP
    xb = x.reshape(rows, in_features).to(torch.bfloat16)
    if padded != in_features:
        xb = torch.cat([xb, xb.new_zeros(rows, padded - in_features)], dim=1)
    xb = xb.contiguous()
    out_features = packed.shape[0] * BLOCK
    if bias is not None and bias.numel() != out_features:
        return None
    y = torch.empty(*x.shape[:-1], out_features)
    lib.gemv_int4_blocks(xb.data_ptr(), rows, padded, packed.data_ptr(), packed.stride(0), scales.data_ptr(),
                         None if bias is None else bias.data_ptr(), y.data_ptr(), out_features, torch.get_num_threads())
    return y
