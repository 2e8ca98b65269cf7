"""Attention kernels for FusedKV reconstruction layers.

Reconstruction layers attend over ``K = sum_s a_s (.) K_s``, ``V = sum_s b_s (.) V_s`` built from
storage-layer caches.  Nothing here ever writes that fused K/V (paper Sec. 2.5: fuse on demand):

* :func:`factored_attention` (pure torch, any T_q, any number of sources): key fusion moved onto the
  query, value fusion onto the output.  CPU path and fallback.
* :func:`materialized_attention`: the explicit reference (builds K, V, calls SDPA).  Tests only.
* :func:`fused_decode_attention` (Triton, T_q = 1): flash-decoding kernel, 1-2 K and 1-2 V sources.
* :func:`decode_attention`: one decode step with the kernel the caller names ("torch" or "triton"), for
  callers outside the model (tests, benchmarks). It chooses nothing: choosing is the engine's, once
  (`fusedkv.engine.selection`, from :func:`triton_decode_fits` and :func:`triton_runs_on`).
* :func:`triton_decode_step`: the kernel launch alone, for the engine's attention implementations, which
  pass their sources as they are.

Triton is optional: it is imported only when a Triton path is actually requested, so this package
imports on machines without Triton or without a GPU.  :func:`is_triton_available` says whether it can
be imported; :func:`triton_usable_for` whether it can run on a given tensor.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from collections.abc import Sequence

import torch

from .reference import (
    factored_attention,
    kv_start_to_mask,
    materialized_attention,
    normalize_sources,
)

Tensor = torch.Tensor

__all__ = [
    "factored_attention",
    "materialized_attention",
    "decode_attention",
    "fused_decode_attention",
    "is_triton_available",
    "triton_usable_for",
    "triton_runs_on",
    "triton_decode_fits",
    "triton_decode_step",
    "kv_start_to_mask",
]

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=1)
def is_triton_available() -> bool:
    """True if ``triton`` can be imported (it says nothing about a GPU being present)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except Exception:  # a broken install must not break the CPU path
        return False
    return True


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_usable_for(t: Tensor) -> bool:
    """Triton can launch on ``t``: it is a CUDA tensor (or the interpreter is on and it is on CPU)."""
    if not is_triton_available():
        return False
    return t.is_cuda or (t.device.type == "cpu" and _interpreter_on())


def triton_runs_on(device: torch.device, dtype: torch.dtype) -> bool:
    """The decode kernel can run on tensors of this device and dtype (a model asks once per device)."""
    if dtype not in TRITON_DTYPES or not is_triton_available():
        return False
    return device.type == "cuda" or (device.type == "cpu" and _interpreter_on())


def triton_decode_fits(head_dim: int, num_k_sources: int, num_v_sources: int) -> bool:
    """The one rule for what the decode kernel takes: 1-2 distinct K and V sources, head_dim a power of
    two in [16, 256]. A layer's sources and head_dim are fixed, so a model asks once per layer."""
    return (1 <= num_k_sources <= 2 and 1 <= num_v_sources <= 2 and 16 <= head_dim <= 256
            and head_dim & (head_dim - 1) == 0)


def triton_decode_step(q: Tensor, k_sources: list[Tensor], k_weights: list[Tensor | None], v_sources: list[Tensor],
                       v_weights: list[Tensor | None], kv_start: Tensor | None = None, scale: float | None = None,
                       **launch) -> Tensor:
    """Launch the decode kernel on arguments already in its form, with no checks: ``q`` [B, H_q, D]; 1-2
    distinct sources per side, [B, H_kv, S, D] with unit stride in D; weights None or contiguous
    [H_kv, D] (any float dtype). For callers that decided once that the kernel fits (the model's
    attention layers); everyone else calls :func:`fused_decode_attention` or :func:`decode_attention`."""
    from .triton_decode import decode_step  # lazy: imports triton

    return decode_step(q, k_sources, k_weights, v_sources, v_weights, kv_start, scale, **launch)


def fused_decode_attention(*args, **kwargs) -> Tensor:
    """Triton flash-decoding kernel, with argument checks; see
    :func:`fusedkv.kernels.triton_decode.fused_decode_attention`."""
    if not is_triton_available():
        raise RuntimeError("fused_decode_attention needs Triton (pip install 'fusedkv[triton]'); "
                           "use factored_attention or decode_attention(kernel='torch') instead")
    q = args[0] if args else kwargs.get("q")
    if isinstance(q, Tensor) and not triton_usable_for(q):
        raise RuntimeError(f"Triton cannot run on a {q.device.type} tensor here: use CUDA tensors, or set "
                           "TRITON_INTERPRET=1 before Python starts to run the kernel on CPU (slow)")
    from .triton_decode import fused_decode_attention as impl  # lazy: imports triton

    return impl(*args, **kwargs)


def decode_attention(
    q: Tensor,
    k_sources: Tensor | Sequence[Tensor],
    k_weights: Tensor | Sequence[Tensor | None] | None,
    v_sources: Tensor | Sequence[Tensor],
    v_weights: Tensor | Sequence[Tensor | None] | None,
    kv_start: Tensor | None = None,
    scale: float | None = None,
    kernel: str = "torch",
    *,
    kv_end: Tensor | None = None,
    **triton_kwargs,
) -> Tensor:
    """One decode step (one new query token) over fused KV sources, for callers outside the model.

    ``q`` is ``[B, H_q, D]`` or ``[B, H_q, 1, D]``; the result has the same shape and q's dtype.
    ``kv_start[b]``: first valid key position (left padding); ``kv_end[b]``: one past the last valid.

    kernel: ``"torch"`` (:func:`factored_attention`) or ``"triton"`` (:func:`fused_decode_attention`; error
    if unavailable; on CPU it needs ``TRITON_INTERPRET=1``). Nothing is chosen here.
    """
    if kernel not in ("torch", "triton"):
        raise ValueError(f"kernel must be 'torch' or 'triton', got {kernel!r}")
    four_d = q.dim() == 4
    if four_d:
        if q.shape[2] != 1:
            raise ValueError(f"decode_attention takes one query token, got T_q={q.shape[2]}")
        q3 = q[:, :, 0, :]
    elif q.dim() == 3:
        q3 = q
    else:
        raise ValueError(f"q must be [B, H_q, D] or [B, H_q, 1, D], got {tuple(q.shape)}")

    ks, kw = normalize_sources(k_sources, k_weights)
    vs, vw = normalize_sources(v_sources, v_weights)
    if kernel == "triton":
        out = fused_decode_attention(q3, ks, kw, vs, vw, kv_start, scale, kv_end=kv_end, **triton_kwargs)
    else:
        mask = kv_start_to_mask(kv_start, ks[0].shape[2], kv_end)
        out = factored_attention(q3.unsqueeze(2), ks, kw, vs, vw, mask=mask, scale=scale)[:, :, 0, :]
    return out.unsqueeze(2) if four_d else out
