"""Decode-friendly weight layout: the projections a one-token step runs, packed for one GEMV each.

At batch 1 a decode step is a chain of matrix-vector products, and how fast BLAS streams a weight
matrix depends on its layout. `nn.Linear` stores W as [out, in] row-major; through MKL, `x @ W.T`
streams it well below the memory bandwidth while the same product over W stored column-major
([in, out] row-major) is faster, and one product over Q|K|V (or gate|up) faster still
(`benchmarks/decode_layout.py` measures the three against the streaming ceiling; figures in
`docs/results.md`).

`pack_for_decode(model)` therefore moves each group of projections that read the same input (Q, K, V
of a storage layer; gate and up of the MLP) into one column-major buffer, and makes every
`nn.Linear.weight` a *view* of its slice. Nothing is copied twice and nothing is renamed: parameter
names, values, `state_dict()` and the optimizer's references are unchanged, training still works,
and `save_pretrained` writes ordinary contiguous tensors. Single projections that gain from the
layout (O, the queries of reconstruction layers, the LM head) are re-stored column-major in place.
The down projection ([hidden, intermediate], tall and thin) streams faster row-major and stays so.
Where the native kernels are built, MoE experts are re-stored column-major per expert too
(`experts_column_major`), and MLA's projections but kv_b_proj (`MLA_PROJECTIONS`), for the native decode step.

A packed group is only used while its parameters still view its buffer: `.to(device)`, `load_state_dict`
with `assign=True` or FSDP replace parameter storage, and the modules then silently go back to
separate products (`PackedLinears.active`). `unpack_weights(model)` restores contiguous row-major
weights and plain `nn.Linear`s.

This module lays weights out; it chooses nothing. The rule it applies, a `ProductRule`, is chosen once by
`fusedkv.engine.selection` (`product_rule`, `set_decode_layout`): at batch x tokens <= `max_rows` the single
GEMV wins; with more rows MKL's small-M GEMM prefers the separate row-major matrices (the same
benchmark), so `PORTABLE` packs up to `PACKED_MAX_ROWS` rows. A packed group applies its rule per call, by
the number of rows only (a prefill block never uses the packed buffer). Nothing re-lays out a model on its
own: `fusedkv.engine.select_runtime` does it only when asked (`generate(weight_layout="auto")`).

Where the native CPU kernel is built (`fusedkv.kernels.cpu_gemv`, f32), every product of a
decode-layout weight up to its `MAX_ROWS` rows runs through it instead of MKL: it streams the
column-major weight faster and splits it across cores, so the selection's rule then packs up to that many
rows and stores the down projection column-major too (`ProductRule.native`). Packing by that rule makes
each single projection a `DecodeLinear` (an `nn.Linear` over the same parameters whose forward hands such
products to that kernel); the model itself is built from plain `nn.Linear`s, so training never consults the kernel.

The way into the model is its documented seam: the projection modules by name, and one slot per group
where an engine object computes the group in one product (`Attention.packed_qkv`, `SwiGLU.packed_gate_up`;
`projection_groups` lists them). `fusedkv.engine.precision` uses the same seam, and the native step
(`fusedkv.engine.native_step`) reads the layout through `decode_products`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu_gemv
from ..model.attention import Attention
from ..model.layers import SwiGLU
from ..model.mla import MLA
from ..model.moe import Experts

PACKED_MAX_ROWS = 2
LAYOUTS = ("packed", "row-major")


@dataclass(frozen=True)
class ProductRule:
    """How decode-layout products run, as `fusedkv.engine.selection.product_rule` chose it: one packed GEMV for
    up to `max_rows` rows; `native`: the native GEMV takes them (`DecodeLinear`), and the tall down projection,
    MoE experts and MLA's projections join the column-major layout (MKL streams them faster row-major)."""

    max_rows: int
    native: bool


PORTABLE = ProductRule(PACKED_MAX_ROWS, False)  # MKL's products (no native kernel)


def projection_groups(module: nn.Module) -> list[tuple[tuple[str, ...], str | None]]:
    """The model's seam: a module's projections grouped by shared input, each group with the slot that
    holds its one product (None for a single projection). Empty for modules without projections here
    (MLA and MoE layers keep their layout)."""
    if isinstance(module, Attention):
        if module.layer.stores:
            return [(("q_proj", "k_proj", "v_proj"), "packed_qkv"), (("o_proj",), None)]
        return [(("q_proj",), None), (("o_proj",), None)]
    if isinstance(module, SwiGLU):
        return [(("gate_proj", "up_proj"), "packed_gate_up"), (("down_proj",), None)]
    return []


class DecodeLinear(nn.Linear):
    """`nn.Linear` over the same parameters, except that a few-row product over a column-major (decode-layout)
    f32 weight on CPU runs the native kernel (`fusedkv.kernels.cpu_gemv.linear`, which declines the rest:
    more rows, autograd, another dtype)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = cpu_gemv.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias) if y is None else y


def _rewrap(cls: type[nn.Linear], linear: nn.Linear) -> nn.Linear:
    """`linear` as a module of class `cls` (`DecodeLinear` or plain `nn.Linear`) holding its very parameters:
    names, values and everyone's references to them are kept."""
    if type(linear) is cls:
        return linear
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    new.in_features, new.out_features = linear.in_features, linear.out_features
    new.weight, new.bias = linear.weight, linear.bias
    return new
class PackedLinears:
    """Several `nn.Linear`s with the same input, stored as one column-major [sum(out), in] buffer whose
    row slices are the modules' weights."""

    def __init__(self, linears: list[nn.Linear], rule: ProductRule = PORTABLE):
        first = linears[0].weight
        self.max_rows, self.native = rule.max_rows, rule.native  # the selection's `ProductRule`
        if any(m.in_features != linears[0].in_features for m in linears):
            raise ValueError("packed projections must share their input size")
        self.linears = linears
        self.sizes = [m.out_features for m in linears]
        # [in, out] row-major storage seen through .t(): a [out, in] weight with column-major strides.
        self.weight = torch.empty(linears[0].in_features, sum(self.sizes), dtype=first.dtype,
                                  device=first.device).t()
        has_bias = [m.bias is not None for m in linears]
        if any(has_bias) and not all(has_bias):
            raise ValueError("packed projections must all have a bias or none")
        self.bias = torch.empty(sum(self.sizes), dtype=first.dtype, device=first.device) if all(has_bias) else None
        offset = 0
        with torch.no_grad():
            for m, n in zip(linears, self.sizes):
                self.weight[offset:offset + n].copy_(m.weight)
                m.weight.data = self.weight[offset:offset + n]
                if self.bias is not None:
                    self.bias[offset:offset + n].copy_(m.bias)
                    m.bias.data = self.bias[offset:offset + n]
                offset += n
        # What `active` checks on every call: each module still holds the same parameter objects, viewing
        # the buffers at the same addresses with the buffer's strides.
        self._views = [(m._parameters, name, m._parameters[name], m._parameters[name].data_ptr())
                       for m in linears for name in ("weight", "bias") if m._parameters.get(name) is not None]
        self._stride = self.weight.stride()

    def active(self) -> bool:
        """True while every module's weight (and bias) is still the matching slice of the buffers (a check
        each packed product makes, so it reads the modules' parameter dicts directly)."""
        for params, name, param, ptr in self._views:
            if params.get(name) is not param or param.data_ptr() != ptr:
                return False
        return self.linears[0]._parameters["weight"].stride() == self._stride

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each projection of `x`: as one packed GEMV for a few rows (the inherent decode / block split),
        else one by one. The packed buffer is not a parameter, so autograd must go through the modules;
        and under torch.compile the storage check cannot be traced (the compiler fuses on its own there)."""
        if (x.numel() // x.shape[-1] > self.max_rows or torch.is_grad_enabled()
                or torch.compiler.is_compiling() or not self.active()):
            return tuple(m(x) for m in self.linears)
        y = cpu_gemv.linear(x, self.weight, self.bias) if self.native else None
        return (F.linear(x, self.weight, self.bias) if y is None else y).split(self.sizes, dim=-1)


def to_column_major(linear: nn.Linear) -> None:
    """Re-store one projection's weight column-major in place (a no-op when it already is)."""
    with torch.no_grad():
        linear.weight.data = linear.weight.data.t().contiguous().t()


def pack_for_decode(model: nn.Module, rule: ProductRule) -> nn.Module:
    """Re-lay out `model`'s projections for fast decoding by `rule` (see the module docstring; the rule is
    `fusedkv.engine.selection.product_rule()`'s). Idempotent; values and outputs are unchanged. Projections
    another engine layout owns (reduced precision) are left as they are. Returns the model."""
    for module in model.modules():
        for names, slot in projection_groups(module):
            linears = [getattr(module, name) for name in names]
            if not all(isinstance(m, nn.Linear) for m in linears):
                continue  # not ours to re-lay out (`fusedkv.engine.precision`)
            if slot is not None:
                if not _is_active(getattr(module, slot)):
                    setattr(module, slot, PackedLinears(linears, rule))
                continue
            if names != ("down_proj",) or rule.native:
                to_column_major(linears[0])
            setattr(module, names[0], _rewrap(DecodeLinear if rule.native else nn.Linear, linears[0]))
        if isinstance(module, Experts) and rule.native:
            experts_column_major(module)
        if isinstance(module, MLA) and rule.native:  # for the native decode step's GEMVs
            for name, linear in _mla_projections(module):
                to_column_major(linear)
                setattr(module, name, _rewrap(DecodeLinear, linear))  # rule.native: the native GEMV
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Linear):
        to_column_major(head)
        model.set_output_embeddings(_rewrap(DecodeLinear if rule.native else nn.Linear, head))
    return model


# MLA's projections the native decode step streams (not kv_b_proj: it is read per head, row-major).
MLA_PROJECTIONS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")


def _mla_projections(module: MLA) -> list[tuple[str, nn.Linear]]:
    """(name, module) of an MLA layer's projections in `MLA_PROJECTIONS` that are f32-capable `nn.Linear`s
    (not another engine layout's)."""
    return [(name, getattr(module, name)) for name in MLA_PROJECTIONS
            if isinstance(getattr(module, name, None), nn.Linear)]


def experts_column_major(experts: Experts) -> None:
    """Re-store each expert's weights column-major in place (W^T [in, out] per expert, same shapes and values),
    the layout the native decode step's GEMVs stream; the module's grouped GEMM takes either layout."""
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(experts, name)
            param.data = param.data.transpose(1, 2).contiguous().transpose(1, 2)


def unpack_weights(model: nn.Module) -> nn.Module:
    """Undo `pack_for_decode`: every parameter contiguous row-major again, nothing shared, plain `nn.Linear`s."""
    with torch.no_grad():
        for module in model.modules():
            for names, slot in projection_groups(module):
                if slot is not None and isinstance(getattr(module, slot), PackedLinears):
                    setattr(module, slot, None)
                elif slot is None and isinstance(getattr(module, names[0]), DecodeLinear):
                    setattr(module, names[0], _rewrap(nn.Linear, getattr(module, names[0])))
            if isinstance(module, MLA):
                for name, linear in _mla_projections(module):
                    setattr(module, name, _rewrap(nn.Linear, linear))
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if isinstance(head, DecodeLinear):
            model.set_output_embeddings(_rewrap(nn.Linear, head))
        for p in model.parameters():
            if not p.is_contiguous():
                p.data = p.data.contiguous()
    return model


def _is_active(group) -> bool:
    """A group slot holds a usable product: a packed buffer its modules still view, or an engine group that
    cannot go stale (`fusedkv.engine.precision.ReducedGroup`)."""
    return group is not None and (not isinstance(group, PackedLinears) or group.active())


def is_packed(model: nn.Module) -> bool:
    """Whether `model` is in a decode layout: some group computes as one product."""
    return any(_is_active(getattr(m, slot)) for m in model.modules() for _, slot in projection_groups(m) if slot)


def decode_products(module: nn.Module) -> dict[str, nn.Module] | None:
    """What a decode step of an `Attention` or `SwiGLU` module multiplies, as the engine laid it out: the
    group product (a `PackedLinears`, or a reduced group's one module) or the projection, per group's first
    name ("q_proj", "o_proj", "gate_proj", "down_proj"); None where a group is not in a decode layout."""
    products = {}
    for names, slot in projection_groups(module):
        if slot is None:
            products[names[0]] = getattr(module, names[0])
            continue
        group = getattr(module, slot)
        if not _is_active(group):
            return None
        products[names[0]] = getattr(group, "linear", group)
    return products


def lay_out(model: nn.Module, layout: str, rule: ProductRule) -> nn.Module:
    """Put `model` in `layout` ("packed" by `rule`, or "row-major"), in place (values and names unchanged; a
    change of layout copies the weights once). Which layout is `fusedkv.engine.selection.set_decode_layout`'s
    choice. Returns the model."""
    if layout not in LAYOUTS:
        raise ValueError(f"weight layout {layout!r}: choose one of {LAYOUTS} (or give a batch size)")
    if layout == LAYOUTS[0]:
        return pack_for_decode(model, rule)
    if any(not p.is_contiguous() for p in model.parameters()):
        unpack_weights(model)
    return model
