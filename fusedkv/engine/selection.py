"""How a model runs, decided once: the one module that chooses, from facts fixed before decoding.

`select_runtime(model, ...)` reads the facts that are fixed before decoding (each layer's sources and
fusion weights from the plan, the model's device and dtype, which kernels are built or importable, the
cache the loop decodes into, the batch) and returns one `Runtime` value after applying it:

  * the weight layout (`set_decode_layout`: packed for one-GEMV steps up to the `ProductRule`'s rows, row-major
    above; packed up to the native step's 16 rows where that step may run);
  * whether the native step runs (`fusedkv.engine.native_step`: one C call per decode step);
  * every attention layer's implementation (`fusedkv.engine.backends`, through the model's `use` seam);
  * the product kernels: the `ProductRule` of the decode layout (native GEMV or MKL) and the GEMM / GEMV
    kernels of reduced-precision weights (`ReducedLinear.gemm_dtype`, `aten_bf16_gemv`);
  * the fused QK-norm + RoPE pass of short f32 blocks (`Attention.fused_qk_rope`) and the MoE dispatch
    (`Experts.grouped`: torch's grouped GEMM where it takes the device and dtype, else one matmul per expert).

The model carries only seams (attributes the runtime sets); it never imports the engine, and a model nobody
selected for runs its own reference forms (transformers' `generate()`, training, scoring). Afterwards nothing
chooses per call except the query length (a decode token, a short block, a long block). Moving or casting
the model resets every seam (`FusedKVModel._apply`). `tests/test_architecture.py` checks that no other
module branches on the device, dtype, backend or kernel availability in code that runs per forward or step.

Implementations (`IMPLEMENTATIONS`): "auto" picks per layer (below); "materialized" (the reference),
"factored", "triton" or "native" force one everywhere (the one-token kernels for one-token steps; blocks then
use SDPA), refusing layers a kernel cannot take. "auto", per layer: a one-token kernel for decode steps where
one runs and takes the layer's sources (Triton where it runs: CUDA, or its interpreter; else the native CPU
kernel where built), the factored form for short blocks of weighted layers, SDPA for the rest; MLA layers
absorb for short blocks.

Served by vLLM (`fusedkv.serving`), a reconstruction layer reads its sources' paged caches in place; how
(`PAGED_PATHS`) is `select_paged_attention`'s choice, made once per layer when serving loads the weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..cache import StaticKVCache
from ..kernels import cpu_gemv, native, triton_decode_fits, triton_runs_on
from ..model.attention import Attention
from ..model.mla import MLA
from ..model.moe import Experts
from .backends import (
    FACTORED_MAX_QUERY,
    AbsorbedMLA,
    Factored,
    LayerFacts,
    Materialized,
    NativeOneToken,
    TritonOneToken,
    f32_block_dtypes,
)
from .native_step import MAX_ROWS as STEP_MAX_ROWS
from .native_step import NativeDecodeStep, Unsupported
from .packing import LAYOUTS, PORTABLE, ProductRule, lay_out, projection_groups
from .precision import ReducedGroup, ReducedLinear, native_bf16

IMPLEMENTATIONS = ("auto", "materialized", "factored", "triton", "native")
WEIGHT_LAYOUTS = ("keep", "auto", *LAYOUTS)
# How a vLLM reconstruction layer attends over paged caches: vLLM's own CPU attention op (one K source), the
# native block-table kernel (CPU), the paged Triton kernel for decode rows (GPU), or each sequence's blocks
# gathered into the factored form (`fusedkv.kernels.reference.factored_attention`).
PAGED_PATHS = ("vllm_op", "native", "triton", "gathered")
# torch's grouped GEMM (`F.grouped_mm`) takes these dtypes on CPU, and bf16 on CUDA (SM >= 80).
GROUPED_MM_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16), "cuda": (torch.bfloat16,)}


@dataclass(frozen=True)
class Runtime:
    """What `select_runtime` chose and applied. As a context manager it gives every seam back the value it had
    before (`restore`) on exit, so a selection made for one generation does not outlive it (training then sees
    the model's own forms); the weight layout stays (it changes no value)."""

    layout: str | None  # the weight layout it put the model in; None: kept as the caller laid it out
    products: ProductRule  # the decode layout's products (native GEMV or MKL)
    attention: dict[int, str]  # each attention layer's implementation, by class name (reports, tests)
    native_step: NativeDecodeStep | None  # one native call per decode step, where it covers model and cache
    fused_qk_rope: bool  # storage layers normalise and rotate short f32 blocks' Q|K in one pass
    moe_grouped: bool  # MoE experts run as one grouped GEMM
    sync: Callable[[], None]  # waits for the device (timing): a no-op on CPU
    previous: tuple = ()  # (object, attribute, value) as they were before

    def restore(self) -> None:
        for obj, name, value in self.previous:
            setattr(obj, name, value)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def product_rule(model: nn.Module) -> ProductRule:
    """The decode layout's products: the native GEMV (f32 on CPU, where built) up to its MAX_ROWS rows, else
    MKL's, packed up to `packing.PACKED_MAX_ROWS` rows (`benchmarks/decode_layout.py`)."""
    param = next(model.parameters())
    if param.device.type == "cpu" and param.dtype == torch.float32 and native.available():
        return ProductRule(cpu_gemv.MAX_ROWS, native=True)
    return PORTABLE


def decode_layout_for(model: nn.Module, batch: int) -> str:
    """The layout a decode batch of `batch` rows wants (one token per row per step)."""
    return LAYOUTS[0] if batch <= product_rule(model).max_rows else LAYOUTS[1]


def set_decode_layout(model: nn.Module, layout_or_batch: str | int) -> nn.Module:
    """Put `model` in a decode layout: "packed", "row-major", or the one a batch size wants, with this
    machine's `product_rule`. In place (values and names unchanged; a change of layout copies the weights
    once). Returns the model."""
    layout = decode_layout_for(model, layout_or_batch) if isinstance(layout_or_batch, int) else layout_or_batch
    return lay_out(model, layout, product_rule(model))


def select_runtime(model, implementation: str = "auto", cache=None, batch: int | None = None,
                   native_step: bool = False, weight_layout: str = "keep") -> Runtime:
    """Decide, once, how `model` (a FusedKV model or its decoder) runs on its current device and dtype, apply
    it, and return it (the module docstring lists what is decided). `weight_layout`: "keep" leaves the layout
    as it is; "auto" the one this batch decodes fastest with (packed where the native step then runs;
    should the step decline the model, the modules' layout for the batch); "packed" / "row-major" force one.
    With `native_step`, the one-call native decode step over `cache` (a `StaticKVCache`, or an empty
    `fusedkv.quant.KIVICache` that knows its max_len, which the step then reserves) for `batch` rows, where it
    covers them."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {implementation!r}: choose one of {IMPLEMENTATIONS}")
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout={weight_layout!r}: choose one of {WEIGHT_LAYOUTS}")
    if (weight_layout == "auto" or native_step) and batch is None:
        raise ValueError("weight_layout='auto' and the native step are chosen for a batch: give batch=")
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    cpu = device.type == "cpu"
    triton = triton_runs_on(device, dtype)
    native_ok = cpu and dtype == torch.float32 and native.available()
    f32_blocks = f32_block_dtypes(cpu)
    if implementation == "native" and not native_ok:
        raise ValueError("the native attention implementation needs an f32 model on CPU with the native kernels "
                         "built (a C compiler; FUSEDKV_NATIVE_KERNELS not 0)")
    decoder = getattr(model, "model", model)
    attention = [layer.self_attn for layer in decoder.layers]
    # Every layer's implementation first, then install them: a layer a forced one cannot take leaves the
    # model as it was.
    plan = model.config.plan
    implementations = [_mla_implementation(attn, implementation) if isinstance(attn, MLA) else
                       _attention_implementation(attn, LayerFacts.of(attn, plan), implementation, cpu,
                                                 f32_blocks, triton, native_ok)
                       for attn in attention]
    # The step reads the packed layout; where it may run, lay the weights out for it first.
    rule = product_rule(model)
    step_may_run = native_step and implementation in ("auto", "native") and cpu and native.available()
    layout = None if weight_layout == "keep" else weight_layout
    if weight_layout == "auto":
        layout = LAYOUTS[0] if step_may_run and batch <= STEP_MAX_ROWS else decode_layout_for(model, batch)
    if layout is not None:
        lay_out(model, layout, rule)

    previous = []
    for attn, chosen in zip(attention, implementations):
        previous.append((attn, "implementation", attn.implementation))
        attn.use(chosen)
    fused_qk_rope = dtype == torch.float32
    for attn in attention:
        if isinstance(attn, Attention) and attn.qk_norm:
            previous.append((attn, "fused_qk_rope", attn.fused_qk_rope))
            attn.fused_qk_rope = fused_qk_rope
    grouped = dtype in GROUPED_MM_DTYPES.get(device.type, ())
    for experts in (m for m in model.modules() if isinstance(m, Experts)):
        previous.append((experts, "grouped", experts.grouped))
        experts.grouped = grouped
    previous += select_products(model)

    step = None
    if step_may_run:
        try:  # the step checks, once, that it covers the model and the cache (`native_step.unsupported`)
            if type(cache) is StaticKVCache:
                step = NativeDecodeStep(model, cache.keys, cache.values, batch, cache.window_start, cache.max_len)
            elif getattr(cache, "quantization", None) == "kivi" and cache.get_seq_length() == 0:
                # KIVI read in place (`fusedkv.kernels.cpu_kivi`); the step reserves the cache's buffers
                step = NativeDecodeStep(model, {}, {}, batch, kivi=cache)
        except Unsupported:
            step = None
    if step is None and weight_layout == "auto" and layout != decode_layout_for(model, batch):
        layout = decode_layout_for(model, batch)  # laid out for a step that declined: the modules' layout
        lay_out(model, layout, rule)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    return Runtime(layout, rule, {attn.layer.index: type(attn.implementation).__name__ for attn in attention},
                   step, fused_qk_rope, grouped, sync, tuple(previous))


def select_products(model: nn.Module) -> list[tuple]:
    """Choose the kernels of every reduced-precision product (`fusedkv.engine.precision.ReducedLinear`), once:
    many rows run oneDNN's bf16 GEMM where the processor has bf16 dot products (bf16 and block weights), and a
    bf16 GEMV of a row or two ATen's kernel with oneDNN off where oneDNN is built. Returns the (object,
    attribute, value) triples it replaced."""
    products = [m for m in model.modules() if isinstance(m, ReducedLinear)]
    for module in model.modules():  # a group's one product sits in its slot, outside the module tree
        products += [getattr(module, slot).linear for _, slot in projection_groups(module)
                     if slot is not None and isinstance(getattr(module, slot), ReducedGroup)]
    bf16, onednn = native_bf16(), torch.backends.mkldnn.is_available()
    previous = []
    for m in products:
        previous += [(m, "gemm_dtype", m.gemm_dtype), (m, "aten_bf16_gemv", m.aten_bf16_gemv)]
        m.gemm_dtype = torch.bfloat16 if bf16 and (m.blocked or m.kernel_dtype == torch.bfloat16) else None
        m.aten_bf16_gemv = onednn and m.kernel_dtype == torch.bfloat16
    return previous


def _attention_implementation(attn: Attention, facts: LayerFacts, implementation: str, cpu: bool,
                              f32_blocks: frozenset, triton: bool, native_ok: bool):
    scale, gqa = attn.scale, attn.num_heads != attn.num_kv_heads
    if attn.softcap:  # soft-capped scores (Gemma 2): only the model's own implementation applies the cap
        if implementation not in ("auto", "materialized"):
            raise ValueError(f"layer {attn.layer.index + 1} soft-caps its attention scores "
                             f"(attn_logit_softcapping); only the 'materialized' implementation applies the cap")
        return None
    if implementation == "materialized":
        return Materialized(scale, gqa, cpu, f32_blocks)
    if implementation == "factored":
        return Factored(scale, gqa, cpu, f32_blocks, max_query=float("inf"))
    if implementation == "triton":
        if not facts.triton_fits:
            raise ValueError(
                f"layer {attn.layer.index + 1}: the Triton decode kernel takes at most 2 K and 2 V sources with "
                f"per-channel (not scalar) weights and a head_dim that is a power of two in [16, 256] "
                f"(head_dim={attn.head_dim}); use the 'factored' or 'materialized' implementation")
        return TritonOneToken(Materialized(scale, gqa, cpu, f32_blocks))
    if implementation == "native":
        if not facts.native_fits:
            raise ValueError(f"layer {attn.layer.index + 1}: the native CPU decode kernel takes 1-2 K and 1-2 V "
                             "sources with per-channel (not scalar) weights; use the 'factored' or 'materialized' "
                             "implementation")
        return NativeOneToken(Materialized(scale, gqa, cpu, f32_blocks))
    blocks = Factored(scale, gqa, cpu, f32_blocks) if facts.weighted else Materialized(scale, gqa, cpu, f32_blocks)
    if triton and facts.triton_fits:
        return TritonOneToken(blocks)
    if native_ok and facts.native_fits:
        return NativeOneToken(blocks)
    return blocks


def _mla_implementation(attn: MLA, implementation: str):
    if implementation in ("triton", "native"):
        raise ValueError(f"attention implementation {implementation!r}: MLA layers take 'auto', 'materialized' "
                         "(expanded) or 'factored' (absorbed); there is no one-token kernel for MLA")
    if implementation == "materialized":
        return None  # the model's own expanded form
    return AbsorbedMLA(float("inf") if implementation == "factored" else FACTORED_MAX_QUERY)


def select_paged_attention(k_sources: Sequence, v_sources: Sequence, *, gpu: bool, head_dim: int,
                           device: torch.device, dtype: torch.dtype, query_dtype: torch.dtype,
                           native_layout: int | None) -> str:
    """How a FusedKV reconstruction layer served by vLLM attends over its sources' paged caches (one of
    `PAGED_PATHS`), chosen once per layer when serving loads the weights (`fusedkv.serving.paged.select_paths`);
    nothing re-checks per call.

    `k_sources` / `v_sources`: the layer's sources as listed (a layer listed twice counts twice); `gpu`: a
    GPU backend (FlashAttention, Triton) rather than the CPU one; `dtype`: the cache's element type;
    `native_layout`: the CPU backend's block layout as the native kernel names it (`native.PAGED_LAYOUTS`: rows,
    key blocks transposed, or AMX-packed bf16), None where the kernel does not read it. GPU: decode rows in the
    paged Triton kernel where it takes the distinct sources and runs on this device and dtype, else gathered
    (prefill chunks are gathered either way). CPU: one K source is vLLM's op; more run in the native kernel where
    it is built and reads the cache, else gathered. Every path takes a sliding window and Gemma 2's soft cap
    (vLLM's op, both kernels and the gathered factored form), so neither decides the path."""
    if gpu:
        kernel = (query_dtype == dtype and triton_runs_on(device, dtype)
                  and triton_decode_fits(head_dim, len(set(k_sources)), len(set(v_sources))))
        return "triton" if kernel else "gathered"
    if len(k_sources) == 1:
        return "vllm_op"
    if native.available() and native.paged_fits(dtype, len(k_sources), len(v_sources), native_layout):
        return "native"
    return "gathered"
