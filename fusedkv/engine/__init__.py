"""How a FusedKV model runs (the model itself, `fusedkv.model`, says only what it is).

  * `selection`: `select_runtime`, the one place that decides how the model runs, once, before decoding: the
    weight layout, the native step, each attention layer's implementation, the product kernels, the fused
    QK-norm + RoPE pass and the MoE dispatch; it returns them as one `Runtime` value.
  * `backends`: the attention implementations it installs (SDPA over the fused K/V, factored, Triton and
    native one-token kernels, absorbed MLA), all behind the model's one interface.
  * `packing`: the decode weight layout (Q|K|V and gate|up as one column-major product; the native GEMV).
  * `precision`: reduced-precision CPU weights (bf16 / f16 / int8 weight-only products).
  * `native_step`: a whole one-token decode step through every layer as one native call.

The engine reaches into the model only through its documented seams: `use(implementation)` on attention
layers, `Attention.fused_qk_rope`, `Experts.grouped`, the projection modules by name and the group slots
(`packing.projection_groups`).
"""

from .packing import is_packed, unpack_weights
from .precision import apply_precision, reduce_precision
from .selection import IMPLEMENTATIONS, Runtime, select_runtime, set_decode_layout

__all__ = ["IMPLEMENTATIONS", "Runtime", "apply_precision", "is_packed", "reduce_precision", "select_runtime",
           "set_decode_layout", "unpack_weights"]
