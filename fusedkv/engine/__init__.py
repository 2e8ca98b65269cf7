"""How a FusedKV model runs (the model itself, `fusedkv.model`, says only what it is).

  * `selection`: `select_runtime`, the one place that decides each attention layer's implementation and
    whether decode steps run as one native call, once, before decoding.
  * `backends`: the attention implementations it installs (SDPA over the fused K/V, factored, Triton and
    native one-token kernels, absorbed MLA), all behind the model's one interface.
  * `packing`: the decode weight layout (Q|K|V and gate|up as one column-major product; the native GEMV).
  * `precision`: reduced-precision CPU weights (bf16 / f16 / int8 weight-only products).
  * `native_step`: a whole one-token decode step through every layer as one native call.

The engine reaches into the model only through its documented seams: `use(implementation)` on attention
layers, the projection modules by name and the group slots (`packing.projection_groups`).
"""

from .packing import is_packed, pack_for_decode, set_decode_layout, unpack_weights
from .precision import apply_precision, reduce_precision
from .selection import ATTENTION_PATHS, Runtime, select_runtime

__all__ = ["ATTENTION_PATHS", "Runtime", "apply_precision", "is_packed", "pack_for_decode", "reduce_precision",
           "select_runtime", "set_decode_layout", "unpack_weights"]
