"""Reduced-precision weights for CPU decoding: 16-bit, int8 and int4 weight-only projections.

At batch 1 a decode step streams every projection weight once, so its time is roughly weight bytes
divided by memory bandwidth: 16-bit weights halve it and int8 quarters it (plus one scale per output
channel). `reduce_precision(model, fmt)` swaps every projection and the LM head for a `ReducedLinear`
that stores its weight in `fmt` and keeps everything else (embeddings, norms, fusion weights, the
residual stream, attention, softmax) in the model's own dtype, as llama.cpp does: only the inputs of
the products are rounded to the weight's kind.

Formats and kernels; which one runs depends on the number of input rows (`GEMV_MAX_ROWS`, measured
by `benchmarks/cpu_decode.py --kernels`):
  * Up to 16 rows wherever the native kernels are built for AVX-512 BF16 or AVX2: `bfloat16` and `int8`
    weights are stored in the block layout of `fusedkv.kernels.cpu_gemv.linear_blocks` and multiplied with
    bf16 dot-product instructions, or on AVX2 widened to f32 in registers (exactly) for f32 FMAs; int8 is
    then scaled per output. `float16` weights take the same blocks wherever AVX2 and F16C are (converted
    to f32 in registers; inputs read in f32, not rounded).
  * Otherwise (no block kernels), few rows: `bfloat16` / `float16` run ATen's
    vectorised reduced-precision GEMV (`F.linear` on 16-bit operands, f32 accumulation; oneDNN is turned off
    around the bf16 call: at one row its bf16 route is the slower of the two); `int8` runs
    `torch.ops.aten._weight_int8pack_mm`, the kernel behind PyTorch's / torchao's int8 weight-only CPU path,
    with the activation dtype it runs fastest with here (`int8_activation_dtype`).
  * `int4` (any processor the native kernels build for): llama.cpp's Q4_0 format (`quantize_int4`: 32 input
    channels per f16 scale, levels -8..7, 4.5 bits per weight; the scale of least squared error) in the blocks of
    `fusedkv.kernels.cpu_gemv.linear_int4`, widened to bf16 by a table look-up where AVX-512 BF16 is
    present, to f32 on AVX2 (else a portable vectorised loop); many rows dequantise it like int8. The LM head
    stays int8 under int4 unless asked (`head_format`), as llama.cpp's Q4 files keep theirs at 6 bits.
  * int8 is symmetric per-output-channel quantisation (scale = max |w| / 127 per row of W), weight-only:
    activations are rounded to the kernel's 16-bit kind, never quantised.
  * Many rows (prefill, large batches): on a processor with bf16 arithmetic, bf16 and int8 weights run
    oneDNN's bf16 GEMM (int8 / int4 dequantised to bf16 first), about twice as fast as the f32 GEMM; f16
    weights (and everything elsewhere) are dequantised to the activation dtype for its GEMM. int4 is
    dequantised product by product into buffers reused by every product (`_int4_gemm_weight`), in passes
    that keep the long axis innermost (no new allocations, no short strided loops).

Which 16-bit kind a processor should use is decided once, from /proc/cpuinfo: bf16 where it has
native bf16 dot products (AVX-512 BF16 / AMX), else f16 (every AVX2 x86 converts f16 in hardware;
PyTorch's bf16 there is emulated and was measured ~24x slower; both have native block products).
`weight_format("half")` applies that rule.

Projections that read the same input (Q|K|V of a storage layer, gate|up) share one buffer, so a
one-row step runs one product per group, like `fusedkv.engine.packing` does for f32. The swapped
model is for inference: its reduced weights are buffers, not parameters.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu_gemv
from ..utils import cpu_flags
from .packing import projection_groups, unpack_weights
from .quantize import (  # noqa: F401 (INT4_RULE, INT4_RULES: read here by callers of precision)
    INT4_RULE,
    INT4_RULES,
    _dequantize_int4,
    int8_activation_dtype,
    quantize_int4,
    quantize_int8,
)

WEIGHT_FORMATS = ("float32", "bfloat16", "float16", "int8", "int4")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# Up to this many input rows a product runs the reduced-precision GEMV kernel (`ReducedLinear`).
GEMV_MAX_ROWS = {"bfloat16": 2, "float16": 8, "int8": 16, "int4": cpu_gemv.BLOCK_MAX_ROWS}


def native_bf16() -> bool:
    """True when the processor has bf16 dot-product instructions (AVX-512 BF16 or AMX-BF16)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def native_f16() -> bool:
    """True when the processor has f16 arithmetic (AVX-512 FP16 or AMX-FP16), not only F16C's conversions."""
    return bool({"avx512_fp16", "amx_fp16"} & cpu_flags())


def half_dtype() -> torch.dtype:
    """The 16-bit weight kind for this processor: bf16 with native bf16 arithmetic, else f16."""
    return torch.bfloat16 if native_bf16() else torch.float16


def weight_format(name: str) -> str:
    """Normalise a user's weight-format name ("f32", "bf16", "fp16", "half", "int8", ...)."""
    aliases = {"f32": "float32", "fp32": "float32", "float": "float32", "bf16": "bfloat16", "f16": "float16",
               "fp16": "float16", "q8": "int8", "q4": "int4"}
    fmt = str(half_dtype()).removeprefix("torch.") if name == "half" else aliases.get(name, name)
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weight format {name!r}: choose one of {', '.join(WEIGHT_FORMATS)} (or half, bf16, f16)")
    return fmt


class ReducedLinear(nn.Module):
    """`y = x W^T + b` with W stored in 16 bits, int8 with per-output-channel scales, or int4 with f16 scales
    per output and group of 32 inputs (`quantize_int4`; the layout of `cpu_gemv.to_int4_blocks`, outputs
    padded to whole blocks of 16: `weight` uint8 [blocks, groups, 8, 32], `scale` f16 [blocks, groups, 16]).

    `x` and `y` keep the caller's dtype; only the product's operands are rounded. The weight is a
    row-major [out, in] buffer (every kernel used reads it so); `weight` may be a row slice of a
    shared buffer (`ReducedGroup`).

    Which kernel runs depends on the number of input rows (measured by `benchmarks/cpu_decode.py
    --kernels`): up to `GEMV_MAX_ROWS[fmt]` the reduced-precision GEMV kernel; above it, as the runtime
    selected (`gemm_dtype`), bf16 weights run oneDNN's bf16 GEMM (native bf16 processors only) and the
    others are dequantised for the GEMM of the activation dtype, so prefill is no slower than in f32."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, fmt: str,
                 in_features: int | None = None, out_features: int | None = None):
        super().__init__()
        self.fmt = fmt
        # A 4-D weight is bf16, int8 or int4 in the native kernels' block layout (`cpu_gemv.to_blocks`).
        self.blocked = weight.dim() == 4
        if self.blocked:
            self.out_features, self.in_features = out_features or weight.shape[0] * cpu_gemv.BLOCK, in_features
        else:
            self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight, persistent=False)
        # int8 only: [out], in the kernel's dtype (f32 for the block kernel)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.kernel_dtype = scale.dtype if fmt == "int8" else weight.dtype
        self.gemv_max_rows = cpu_gemv.BLOCK_MAX_ROWS if self.blocked else GEMV_MAX_ROWS[fmt]
        # The runtime's product kernels (`fusedkv.engine.selection.select_products` sets them, once): many rows
        # run the GEMM in `gemm_dtype` (bf16 on a bf16 processor: oneDNN's bf16 GEMM) or, None, dequantised
        # to the activation dtype; a bf16 GEMV of a row or two runs ATen's kernel with oneDNN off
        # (`aten_bf16_gemv`). Unselected, the portable products.
        self.gemm_dtype: torch.dtype | None = None
        self.aten_bf16_gemv = False

    @classmethod
    def from_linears(cls, linears: list[nn.Linear], fmt: str, int4_rule: str | None = None) -> ReducedLinear:
        """One reduced module over the stacked weights of `linears` (which share their input); `int4_rule` is
        `quantize_int4`'s `rule`."""
        weight = torch.cat([m.weight.detach() for m in linears]).float()
        biases = [m.bias for m in linears]
        bias = torch.cat([b.detach() for b in biases]).float() if all(b is not None for b in biases) else None
        if any(b is not None for b in biases) and bias is None:
            raise ValueError("grouped projections must all have a bias or none")
        # Slices of a group stay whole blocks; a single product (an LM head of any vocabulary) is padded to them,
        # so its logits come from the block kernel in f32 rather than a 16-bit GEMV's rounded output.
        blocks = ((fmt in ("bfloat16", "int8") and cpu_gemv.blocks_available()
                   or fmt == "float16" and cpu_gemv.f16_blocks_available())
                  and (len(linears) == 1 or all(m.out_features % cpu_gemv.BLOCK == 0 for m in linears)))
        if fmt == "int4":
            # Every int4 product is a block product (outputs padded to whole blocks), except a slice of a group
            # member whose outputs are not whole blocks: that group keeps its dequantised weight in f32.
            q, scale = quantize_int4(weight, rule=int4_rule)
            if len(linears) == 1 or all(m.out_features % cpu_gemv.BLOCK == 0 for m in linears):
                packed, scales = cpu_gemv.to_int4_blocks(q, scale)
                return cls(packed, scales, bias, fmt, in_features=weight.shape[1], out_features=weight.shape[0])
            return cls(_dequantize_int4(q, scale), None, bias, fmt)
        out_features, in_features = weight.shape
        if fmt == "int8":
            q, scale = quantize_int8(weight)
            if blocks:
                q, scale = _pad_rows(q, cpu_gemv.BLOCK), _pad_rows(scale, cpu_gemv.BLOCK)
                return cls(cpu_gemv.to_blocks(q), scale, bias, fmt, in_features, out_features)
            return cls(q, scale.to(int8_activation_dtype()), bias, fmt)
        if blocks:
            padded = _pad_rows(weight, cpu_gemv.BLOCK)
            layout = cpu_gemv.to_blocks(padded.half()) if fmt == "float16" else cpu_gemv.to_bf16_blocks(padded)
            return cls(layout, None, bias, fmt, in_features, out_features)
        return cls(weight.to(_DTYPES[fmt]).contiguous(), None, bias, fmt)

    def slice(self, start: int, stop: int) -> ReducedLinear:
        """A module over output rows [start, stop) that shares this one's storage."""
        bias = None if self.bias is None else self.bias[start:stop]
        scale = None if self.scale is None else self.scale[start:stop]
        if self.blocked:
            block = cpu_gemv.BLOCK
            if self.fmt == "int4":  # group scales are stored per block, as the levels
                scale = self.scale[start // block:stop // block]
            return ReducedLinear(self.weight[start // block:stop // block], scale, bias, self.fmt, self.in_features,
                                 stop - start)
        return ReducedLinear(self.weight[start:stop], scale, bias, self.fmt)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if self.fmt == "int4":
            if not self.blocked:
                return self.weight.to(dtype)
            return self._gemm_weight(dtype).contiguous()
        n = self.out_features
        weight = cpu_gemv.from_blocks(self.weight, self.in_features)[:n] if self.blocked else self.weight
        if self.fmt == "int8":
            return weight.to(dtype) * self.scale[:n].to(dtype)[:, None]
        return weight.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows <= self.gemv_max_rows:
            y = self._gemv(x.reshape(rows, self.in_features))
        elif self.gemm_dtype is not None:
            y = F.linear(x.reshape(rows, self.in_features).to(self.gemm_dtype), self._gemm_weight(self.gemm_dtype))
        else:
            y = F.linear(x.reshape(rows, self.in_features), self._gemm_weight(x.dtype))
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def _gemm_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The [out, in] weight in `dtype` for a GEMM; int4 blocks in a reused buffer (use it at once)."""
        if self.fmt == "int4" and self.blocked:
            return _int4_gemm_weight(self.weight, self.scale, self.in_features, self.out_features, dtype)
        return self.dequantized(dtype)

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        if self.fmt == "int4":  # x rounded to bf16 (by the kernel), times the exact dequantised weight
            y = cpu_gemv.linear_int4(x.float(), self.weight, self.scale, self.in_features) if self.blocked else None
            if y is None:
                return F.linear(x.to(torch.bfloat16).float(), self.dequantized(torch.float32))
            return y[:, :self.out_features]
        if self.blocked:  # the native kernel rounds x to bf16 itself, f16's reads it in f32 (padded outputs are cut)
            y = cpu_gemv.linear_blocks(x.float(), self.weight, self.in_features, self.scale)
            if y is None:
                dtype = torch.float16 if self.fmt == "float16" else torch.bfloat16
                return F.linear(x.to(dtype), self.dequantized(dtype))
            return y[:, :self.out_features]
        x = x.to(self.kernel_dtype)
        if self.fmt == "int8":
            return torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scale)
        if not self.aten_bf16_gemv:
            return F.linear(x, self.weight)
        # bf16 at a row or two: ATen's vectorised GEMV, not oneDNN (slower there, faster above).
        enabled = torch._C._get_mkldnn_enabled()
        torch._C._set_mkldnn_enabled(False)
        try:
            return F.linear(x, self.weight)
        finally:
            torch._C._set_mkldnn_enabled(enabled)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"


class ReducedGroup:
    """Q|K|V (or gate|up) in one `ReducedLinear`, in the group slot of the model's seam (as
    `packing.PackedLinears`): `__call__(x) -> one output per projection`. It never goes stale."""

    def __init__(self, linear: ReducedLinear, sizes: list[int]):
        self.linear, self.sizes = linear, sizes

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(x).split(self.sizes, dim=-1)


class _Scratch(threading.local):
    """Buffers every int4 GEMM product of a thread reuses (`_int4_gemm_weight`), grown to the largest weight
    and kept: a prefill then allocates (and page-faults) them once instead of once per product."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self.buffers.get(name)
        # one made under torch.inference_mode cannot be written outside it (a prefill after generate's)
        stale = buf is not None and buf.is_inference() and not torch.is_inference_mode_enabled()
        if buf is None or stale or buf.numel() < numel or buf.dtype != dtype:
            buf = self.buffers[name] = torch.empty(numel, dtype=dtype)
        return buf[:numel]


_SCRATCH = _Scratch()


def _int4_gemm_weight(packed: torch.Tensor, scales: torch.Tensor, in_features: int, out_features: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """The weight scale (.) q of int4 blocks (`cpu_gemv.to_int4_blocks`) in `dtype` (computed exactly in f32,
    then rounded once), as an [out, in] view of an [in, out] buffer that the next call of this thread
    overwrites: a GEMM takes it as is (a transposed operand costs it nothing). Four passes, each with the
    output axis innermost: the nibbles, one permuting copy to f32, the scales, the cast."""
    blocks, groups = packed.shape[:2]
    g, b = cpu_gemv.GROUP, cpu_gemv.BLOCK
    n = blocks * groups * g * b
    nibbles = _SCRATCH.get("nibbles", n, torch.uint8).view(blocks, groups, g // 4, 2, 2 * b)
    torch.bitwise_and(packed, 15, out=nibbles[:, :, :, 0])
    torch.bitwise_right_shift(packed, 4, out=nibbles[:, :, :, 1])
    # nibble [block, group, c, h, output o, j] holds q + 8 of output 16 block + o, input 32 group + 4c + 2h + j
    w = _SCRATCH.get("float32", n, torch.float32).view(groups, g // 4, 2, 2, blocks, b)
    w.copy_(nibbles.view(blocks, groups, g // 4, 2, b, 2).permute(1, 2, 3, 5, 0, 4))
    w = w.view(groups, g, blocks * b)
    w.sub_(8).mul_(scales.permute(1, 0, 2).reshape(groups, 1, blocks * b))  # f16 scale x level: exact in f32
    if dtype != torch.float32:
        w = _SCRATCH.get(str(dtype), n, dtype).view_as(w).copy_(w)
    return w.view(groups * g, blocks * b)[:in_features, :out_features].t()


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """`t` with zero rows appended up to a multiple of `multiple` (outputs padded to whole blocks)."""
    pad = -t.shape[0] % multiple
    return t if not pad else torch.cat([t, t.new_zeros(pad, *t.shape[1:])])


def _grouped(linears: list[nn.Linear], fmt: str, int4_rule: str | None
             ) -> tuple[list[ReducedLinear], ReducedGroup]:
    whole = ReducedLinear.from_linears(linears, fmt, int4_rule)
    parts, offset = [], 0
    for m in linears:
        parts.append(whole.slice(offset, offset + m.out_features))
        offset += m.out_features
    return parts, ReducedGroup(whole, [m.out_features for m in linears])


def head_format(fmt: str, head: str | None = None) -> str:
    """The LM head's weight format for projections in `fmt`: `head` when given, else int8 under int4 weights
    (`DEFAULT_INT4_HEAD`) and `fmt` otherwise. The head is the one product whose error reaches the logits
    directly and nothing averages it out; llama.cpp's Q4_0 / Q4_K_M files keep theirs at 6 bits (Q6_K) for
    that reason. On the trained model of docs/cpu-decode.md ("int4 against Q4_0 / Q4_K_M") an int4 head alone
    cost nearly all of int4's top-1 agreement, and an int8 one almost none."""
    fmt = weight_format(fmt)
    return weight_format(head) if head is not None else DEFAULT_INT4_HEAD if fmt == "int4" else fmt


DEFAULT_INT4_HEAD = "int8"


@torch.no_grad()
def reduce_precision(model: nn.Module, fmt: str, head: str | None = None, int4_rule: str | None = None) -> nn.Module:
    """Store every projection of `model` in `fmt` and its LM head in `head_format(fmt, head)` (int8 under int4
    unless `head` says otherwise; see the module docstring); the rest of the model keeps its dtype. In place;
    returns the model. "float32" (with an f32 head) leaves it unchanged. `int4_rule`: how int4 groups choose
    their scales (`quantize_int4`; default `INT4_RULE`)."""
    fmt, head_fmt = weight_format(fmt), head_format(fmt, head)
    if fmt == "float32" and head_fmt == "float32":
        return model
    if "int8" in (fmt, head_fmt) and not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        raise ValueError("--weights int8 needs torch.ops.aten._weight_int8pack_mm (PyTorch >= 2.3)")
    if is_reduced(model):
        raise ValueError("the model's weights are already reduced; reduce a fresh float model")
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ValueError("reduced-precision weights are a CPU decode path; on a GPU use --dtype bfloat16 for "
                         "the whole model instead")
    unpack_weights(model)  # plain row-major nn.Linear weights to read from
    for module in list(model.modules()) if fmt != "float32" else []:
        # The model's seam (`fusedkv.engine.packing.projection_groups`): a group becomes one reduced product
        # in its slot, with its projections as slices of it; a single projection becomes a `ReducedLinear`.
        for names, slot in projection_groups(module):
            linears = [getattr(module, name) for name in names]
            if slot is None:
                setattr(module, names[0], ReducedLinear.from_linears(linears, fmt, int4_rule))
                continue
            parts, group = _grouped(linears, fmt, int4_rule)
            for name, part in zip(names, parts):
                setattr(module, name, part)
            setattr(module, slot, group)
    lm_head = model.get_output_embeddings()
    if isinstance(lm_head, nn.Linear) and head_fmt != "float32":
        # An LM head tied to the embeddings stays tied in f32 in the embedding table; the head's copy
        # is the reduced one (decode reads the head every step, the embedding one row).
        model.set_output_embeddings(ReducedLinear.from_linears([lm_head], head_fmt, int4_rule))
    model.reduced_precision = fmt
    model.reduced_head = head_fmt
    return model


def is_reduced(model: nn.Module) -> bool:
    return getattr(model, "reduced_precision", None) is not None


def weight_nbytes(model: nn.Module) -> int:
    """Bytes a decode step streams for weights: every projection and the LM head (reduced or not),
    excluding the embedding table (one row read per token)."""
    total = 0
    for m in model.modules():
        if isinstance(m, ReducedLinear):
            total += sum(t.numel() * t.element_size() for t in (m.weight, m.scale, m.bias) if t is not None)
        elif isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
            total += 0 if m.bias is None else m.bias.numel() * m.bias.element_size()
    return total


def kv_dtype_for(name: str) -> torch.dtype:
    """A KV cache dtype from a user's name: float32, bfloat16, float16, or half (this processor's)."""
    fmt = weight_format(name)
    if fmt in ("int8", "int4"):
        raise ValueError(f"an {fmt} KV cache is not implemented; use float32, bfloat16, float16 or half")
    return torch.float32 if fmt == "float32" else _DTYPES[fmt]


def apply_precision(model: nn.Module, dtype: str = "float32", weights: str | None = None,
                    kv_dtype: str | None = None, head: str | None = None) -> torch.dtype:
    """The command-line choice, made once before decoding: `dtype` for weights and KV cache, `weights`
    (e.g. int8), `kv_dtype` and `head` (the LM head's format, `head_format`) overriding them. On CPU,
    reduced weights are `ReducedLinear`s under f32 activations; on a GPU a 16-bit `dtype` casts the whole
    model. Returns the KV cache dtype (for `StaticKVCache`)."""
    kv = kv_dtype_for(kv_dtype or dtype)
    fmt = weight_format(weights or dtype)
    if next(model.parameters()).device.type != "cpu":
        if fmt in ("int8", "int4") or head is not None:
            raise ValueError(f"--weights {fmt} / --head-weights are a CPU decode path; on a GPU use --dtype bfloat16")
        model.to(torch.float32 if fmt == "float32" else _DTYPES[fmt])
        return kv
    reduce_precision(model, fmt, head)
    return kv


SHORT_NAMES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int8": "int8", "int4": "int4"}
