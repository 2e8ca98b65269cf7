"""Triton decode-kernel cases for the Triton CPU interpreter.

Not collected by the main pytest run (the name does not start with ``test_``): ``test_triton_kernel.py``
runs this file with pytest in a subprocess whose environment has ``TRITON_INTERPRET=1`` from the start,
because the interpreter must be on before Triton is first imported (and ``import fusedkv`` already
imports it through transformers).  Shapes are tiny: the interpreter executes each program in numpy.
"""

from __future__ import annotations

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/kernels/test_triton_kernel.py"

from fusedkv.engine import select_runtime  # noqa: E402
from fusedkv.kernels import (  # noqa: E402
    decode_attention,
    fused_decode_attention,
    kv_start_to_mask,
    materialized_attention,
    triton_usable_for,
)

D = 16


def _case(b, h_kv, g, s, n_k, n_v, weighted, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    q = rnd(b, h_kv * g, D)
    ks = [rnd(b, h_kv, s, D) for _ in range(n_k)]
    vs = [rnd(b, h_kv, s, D) for _ in range(n_v)]
    kw = [rnd(h_kv, D) if weighted else None for _ in range(n_k)]
    vw = [rnd(h_kv, D) if weighted else None for _ in range(n_v)]
    low = [x.to(dtype) for x in (q, *ks, *vs)]
    return (low[0], low[1:1 + n_k], kw, low[1 + n_k:], vw), (q, ks, kw, vs, vw)


def _reference(args32, kv_start, s, kv_end=None):
    q, ks, kw, vs, vw = args32
    ref = materialized_attention(q[:, :, None], ks, kw, vs, vw, mask=kv_start_to_mask(kv_start, s, kv_end))
    return ref[:, :, 0]


def test_interpreter_is_on():
    assert triton_usable_for(torch.zeros(1))


# S = 37 is not a multiple of the 16-key block; batch row 1 is left-padded by 5.
@pytest.mark.parametrize("g", [1, 2])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("plan", ["fusedkv", "plain"])
def test_matches_materialized_fp32(g, num_splits, plan):
    s = 37
    if plan == "fusedkv":
        args, args32 = _case(2, 2, g, s, 2, 2, True)
    else:
        args, args32 = _case(2, 2, g, s, 1, 1, False)
    kv_start = torch.tensor([0, 5])
    out = fused_decode_attention(*args, kv_start=kv_start, num_splits=num_splits, block_n=16)
    assert out.shape == args[0].shape and out.dtype == torch.float32
    assert (out - _reference(args32, kv_start, s)).abs().max().item() < 1e-4


def test_dot_path_many_heads_and_mixed_sources():
    """G = 16 uses tl.dot; 2 K sources (one weighted), 1 weighted V source; automatic split/block."""
    s = 40
    args, args32 = _case(2, 1, 16, s, 2, 1, True)
    args[2][1] = args32[2][1] = None
    kv_start = torch.tensor([0, 9])
    out = fused_decode_attention(*args, kv_start=kv_start, num_splits=2)
    assert (out - _reference(args32, kv_start, s)).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("g", [2, 8])
def test_low_precision(dtype, g):
    s = 33
    args, args32 = _case(2, 1, g, s, 2, 2, True, dtype=dtype)
    args32 = (args[0].float(), [x.float() for x in args[1]], args[2], [x.float() for x in args[3]], args[4])
    kv_start = torch.tensor([3, 0])
    out = fused_decode_attention(*args, kv_start=kv_start, num_splits=2, block_n=16)
    assert out.dtype == dtype
    ref = _reference(args32, kv_start, s)
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 2e-2


def test_kv_end_fully_masked_row_and_empty_splits():
    s = 50
    args, args32 = _case(3, 2, 2, s, 2, 2, True)
    kv_start = torch.tensor([0, 40, 60])  # row 1 lives in the last split only; row 2 sees nothing
    kv_end = torch.tensor([50, 45, 50])
    for ns in (1, 4):
        out = fused_decode_attention(*args, kv_start=kv_start, num_splits=ns, block_n=16, kv_end=kv_end)
        assert torch.isfinite(out).all()
        assert out[2].abs().max() == 0
        assert (out - _reference(args32, kv_start, s, kv_end)).abs().max().item() < 1e-4


def test_dispatcher_and_duplicate_sources():
    s = 21
    args, args32 = _case(1, 2, 2, s, 1, 1, True)
    q, (k,), (a,), (v,), (c,) = args
    kv_start = torch.tensor([2])
    # k listed twice (merged into one weighted source) and also used as a V source: 3 V entries -> 2 distinct
    ks, kw, vs, vw = [k, k], [a, None], [v, k, v], [c, None, None]
    out = decode_attention(q[:, :, None], ks, kw, vs, vw, kv_start, kernel="triton",
                           num_splits=2, block_n=16)
    ref = materialized_attention(q[:, :, None], ks, kw, vs, vw, mask=kv_start_to_mask(kv_start, s))
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() < 1e-4


def test_argument_errors():
    args, _ = _case(1, 2, 1, 8, 1, 1, False)
    q, ks, _, vs, _ = args
    with pytest.raises(NotImplementedError):
        fused_decode_attention(q, [ks[0], ks[0] * 2, ks[0] * 3], None, vs, None)
    with pytest.raises(ValueError):
        fused_decode_attention(q[:, :, :12], [k[..., :12] for k in ks], None, [v[..., :12] for v in vs], None)
    with pytest.raises(ValueError):
        fused_decode_attention(q[:, :, None], ks, None, vs, None)


# ---- the model's decode through the kernel: the layer decides once, then launches with its sources as
# they are. Auto (Triton under the interpreter) must equal the full forward, left padding included.
@pytest.mark.parametrize("plan", ["vanilla", "fusedkv", "fusedkv-lite", "fusedkv-gqa", "fusedkv-iterative"])
def test_model_decode_through_the_kernel(plan):
    from tests.conftest import tiny_model
    from tests.model.test_decode import incremental_logits, padded_batch

    model = tiny_model(plan)
    assert select_runtime(model).attention[len(model.model.layers) - 1] == "TritonOneToken"
    ids, mask, width = padded_batch(7)
    with torch.no_grad():
        steps, _ = incremental_logits(model, ids, mask, width)
        select_runtime(model, "materialized")
        full = model(ids, attention_mask=mask).logits
    got = torch.cat(steps, dim=1)
    real = mask.bool()
    assert (got - full)[real].abs().max().item() < 1e-4


@pytest.mark.parametrize("plan, shared", [("vanilla", None), ("fusedkv", ["sliding_attention"]), ("fusedkv", None)])
def test_sliding_window_decode_through_the_kernel(plan, shared):
    # Window layers hand the kernel their kept keys with kv_start moved into the window.
    from tests.model.test_decode import incremental_logits, padded_batch
    from tests.model.test_sliding_window import WINDOW, hybrid_model

    model = hybrid_model(plan, shared)
    assert select_runtime(model).attention[0] == "TritonOneToken"
    ids, mask, width = padded_batch(3 * WINDOW)
    with torch.no_grad():
        steps, _ = incremental_logits(model, ids, mask, width)
        select_runtime(model, "materialized")
        full = model(ids, attention_mask=mask).logits
    got = torch.cat(steps, dim=1)
    assert (got - full)[mask.bool()].abs().max().item() < 1e-4
