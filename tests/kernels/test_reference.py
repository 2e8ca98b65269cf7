"""Factored (fusion-free) attention against the materialised reference, in pure torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fusedkv.kernels import (
    decode_attention,
    factored_attention,
    is_triton_available,
    kv_start_to_mask,
    materialized_attention,
)
from fusedkv.kernels.reference import expand_weight, merge_duplicate_sources

REPO = Path(__file__).resolve().parents[2]


def _inputs(b, h_kv, g, t_q, s, d, n_k, n_v, weighted, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q = rnd(b, h_kv * g, t_q, d)
    ks = [rnd(b, h_kv, s, d) for _ in range(n_k)]
    vs = [rnd(b, h_kv, s, d) for _ in range(n_v)]
    kw = [rnd(h_kv, d) if weighted else None for _ in range(n_k)]
    vw = [rnd(h_kv, d) if weighted else None for _ in range(n_v)]
    return q, ks, kw, vs, vw


def _causal_left_pad_mask(b, t_q, s, pad):
    """Queries are the last t_q positions; row i of batch j sees keys pad[j] <= t <= s - t_q + i.

    With pad[j] > s - t_q the first query rows of that batch see no key at all (fully masked)."""
    pos_k = torch.arange(s)
    pos_q = torch.arange(s - t_q, s)
    causal = pos_k[None, :] <= pos_q[:, None]  # [t_q, s]
    left = pos_k[None, :] >= torch.tensor(pad)[:, None]  # [b, s]
    return (causal[None] & left[:, None, :])[:, None]  # [b, 1, t_q, s]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("g", [1, 2, 4])
@pytest.mark.parametrize("t_q", [1, 5])
@pytest.mark.parametrize("n_src,weighted", [(1, False), (1, True), (2, False), (2, True)])
def test_factored_matches_materialized(dtype, tol, g, t_q, n_src, weighted):
    b, h_kv, s, d = 3, 2, 11, 8
    q, ks, kw, vs, vw = _inputs(b, h_kv, g, t_q, s, d, n_src, n_src, weighted, dtype)
    # batch 0: no padding; batch 1: left pad 3; batch 2: padded past the first query rows.
    mask = _causal_left_pad_mask(b, t_q, s, [0, 3, s - 2])
    ref = materialized_attention(q, ks, kw, vs, vw, mask=mask)
    out = factored_attention(q, ks, kw, vs, vw, mask=mask)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max().item() < tol
    # unmasked too
    ref = materialized_attention(q, ks, kw, vs, vw)
    out = factored_attention(q, ks, kw, vs, vw)
    assert (out - ref).abs().max().item() < tol


@pytest.mark.parametrize("g", [1, 2])
def test_soft_capping_matches_capped_materialised_scores(g):
    """Gemma 2's soft cap on the factored scores equals it on the scores of the materialised fused K
    (float64: c tanh(s / c) over (q k_fused^T) * scale, the causal left-padded mask, fused V)."""
    b, h_kv, t_q, s, d, cap, scale = 3, 2, 4, 9, 8, 0.7, 0.4
    q, ks, kw, vs, vw = _inputs(b, h_kv, g, t_q, s, d, 2, 2, True, torch.float64, seed=3)
    mask = _causal_left_pad_mask(b, t_q, s, [0, 2, 4])
    k = sum(w[None, :, None, :] * src for src, w in zip(ks, kw)).repeat_interleave(g, dim=1)
    v = sum(w[None, :, None, :] * src for src, w in zip(vs, vw)).repeat_interleave(g, dim=1)
    scores = torch.tanh(q @ k.transpose(-1, -2) * scale / cap) * cap
    ref = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
    out = factored_attention(q, ks, kw, vs, vw, mask=mask, scale=scale, softcap=cap)
    assert (out - ref).abs().max().item() < 1e-10
    uncapped = factored_attention(q, ks, kw, vs, vw, mask=mask, scale=scale)
    assert (uncapped - ref).abs().max().item() > 1e-3  # the cap is doing something at these scales


def test_fully_masked_rows_are_zero():
    q, ks, kw, vs, vw = _inputs(2, 2, 2, 5, 9, 8, 2, 2, True, torch.float64)
    mask = _causal_left_pad_mask(2, 5, 9, [0, 7])  # batch 1: query rows 0, 1 see nothing
    for fn in (factored_attention, materialized_attention):
        out = fn(q, ks, kw, vs, vw, mask=mask)
        assert torch.isfinite(out).all()
        assert out[1, :, :2].abs().max() == 0
        assert out[1, :, 2:].abs().max() > 0


def test_mixed_plans_and_per_head_mask():
    """Lite (K^n, V^1), mixed weights, different K/V source counts, a [B, H_q, T_q, S] mask."""
    dtype = torch.float64
    b, h_kv, g, t_q, s, d = 2, 2, 3, 4, 10, 16
    q, ks, _, vs, _ = _inputs(b, h_kv, g, t_q, s, d, 2, 2, False, dtype)
    a = torch.randn(h_kv, d, dtype=dtype)
    c = torch.randn(d, dtype=dtype)  # a [D] weight shared by the kv heads
    mask = torch.rand(b, h_kv * g, t_q, s) > 0.3
    mask[..., -1] = True
    for args in [(ks[1], None, vs[0], None), ([ks[0], ks[1]], [a, None], [vs[1]], [c]),
                 ([ks[0]], [c], [vs[0], vs[1]], [None, a])]:
        ref = materialized_attention(q, *args, mask=mask, scale=0.3)
        out = factored_attention(q, *args, mask=mask, scale=0.3)
        assert (out - ref).abs().max().item() < 1e-10


def test_float_mask_and_same_tensor_as_k_and_v():
    dtype = torch.float64
    q, ks, kw, _, _ = _inputs(2, 2, 2, 3, 7, 8, 2, 0, True, dtype)
    bias = torch.randn(2, 1, 3, 7, dtype=dtype)
    # one tensor listed twice as a K source and also used as the V source
    args = ([ks[0], ks[0], ks[1]], [kw[0], None, kw[1]], [ks[0]], [kw[1]])
    ref = materialized_attention(q, *args, mask=bias)
    out = factored_attention(q, *args, mask=bias)
    assert (out - ref).abs().max().item() < 1e-10


def test_merge_duplicates_and_weight_shapes():
    x, y = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    w = torch.randn(2, 4, dtype=torch.float64)
    srcs, ws = merge_duplicate_sources([x, y, x], [w, None, None])
    assert len(srcs) == 2 and srcs[0] is x and ws[1] is None
    assert ws[0].dtype == torch.float64 and torch.allclose(ws[0], w + 1)
    assert expand_weight(torch.ones(4), 2, 4).shape == (2, 4)
    assert expand_weight(torch.ones(8), 2, 4).shape == (2, 4)
    with pytest.raises(ValueError):
        expand_weight(torch.ones(5), 2, 4)


def test_low_precision_inputs_return_input_dtype():
    q, ks, kw, vs, vw = _inputs(1, 2, 2, 1, 6, 8, 2, 2, True, torch.float32)
    ref = factored_attention(q, ks, kw, vs, vw)
    out = factored_attention(q.bfloat16(), [k.bfloat16() for k in ks], kw, [v.bfloat16() for v in vs], vw)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 2e-2


def test_matches_plain_sdpa_for_one_source():
    """One source without weights is ordinary (GQA) attention."""
    q, ks, _, vs, _ = _inputs(2, 2, 4, 3, 9, 8, 1, 1, False, torch.float64)
    ref = F.scaled_dot_product_attention(q, ks[0], vs[0], enable_gqa=True)
    assert (factored_attention(q, ks[0], None, vs[0], None) - ref).abs().max() < 1e-10


def test_decode_attention_torch_kernel():
    q, ks, kw, vs, vw = _inputs(3, 2, 2, 1, 12, 8, 2, 2, True, torch.float64)
    kv_start = torch.tensor([0, 4, 12])  # last row fully masked
    kv_end = torch.tensor([12, 10, 12])
    mask = kv_start_to_mask(kv_start, 12, kv_end)
    ref = materialized_attention(q, ks, kw, vs, vw, mask=mask)
    out4 = decode_attention(q, ks, kw, vs, vw, kv_start, kv_end=kv_end)  # the default kernel: torch
    out3 = decode_attention(q[:, :, 0], ks, kw, vs, vw, kv_start, kv_end=kv_end, kernel="torch")
    assert out4.shape == q.shape and out3.shape == q[:, :, 0].shape
    assert (out4 - ref).abs().max() < 1e-10 and (out3 - ref[:, :, 0]).abs().max() < 1e-10
    assert out3[2].abs().max() == 0
    with pytest.raises(ValueError):
        decode_attention(q, ks, kw, vs, vw, kernel="nope")
    with pytest.raises(ValueError):
        decode_attention(torch.randn(3, 4, 2, 8, dtype=torch.float64), ks, kw, vs, vw)


def test_argument_errors():
    q, ks, kw, vs, vw = _inputs(1, 2, 1, 1, 5, 8, 2, 2, True, torch.float32)
    with pytest.raises(ValueError):
        factored_attention(q, ks, kw[:1], vs, vw)
    with pytest.raises(ValueError):
        factored_attention(torch.randn(1, 3, 1, 8), ks, kw, vs, vw)  # 3 heads vs 2 kv heads
    with pytest.raises(ValueError):
        factored_attention(q, [ks[0], torch.randn(1, 2, 6, 8)], None, vs, None)


def test_is_triton_available_is_bool():
    assert isinstance(is_triton_available(), bool)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"), reason="interpreter is on")
def test_triton_kernel_on_cpu_without_interpreter_is_a_clear_error():
    q, ks, kw, vs, vw = _inputs(1, 2, 1, 1, 5, 16, 1, 1, False, torch.float32)
    with pytest.raises(RuntimeError, match="Triton"):
        decode_attention(q, ks, kw, vs, vw, kernel="triton")


@pytest.mark.slow  # a fresh interpreter: the fast tier (-m 'not slow') leaves it to the full suite
def test_package_works_without_triton():
    """With triton unimportable: the package imports, reports it, and dispatches to torch."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "import fusedkv.kernels as K\n"
        "assert K.is_triton_available() is False\n"
        "q = torch.randn(1, 4, 1, 8); k = torch.randn(1, 2, 5, 8)\n"
        "out = K.decode_attention(q, [k, k * 2], None, k, None)\n"
        "assert out.shape == q.shape\n"
        "try:\n"
        "    K.fused_decode_attention(q[:, :, 0], k, None, k, None)\n"
        "except RuntimeError as e:\n"
        "    assert 'Triton' in str(e)\n"
        "else:\n"
        "    raise AssertionError('expected RuntimeError')\n"
        "print('OK')\n"
    )
    # Import fusedkv.kernels.reference-only pieces: fusedkv/__init__ may import transformers, which
    # probes triton itself; a None entry in sys.modules makes that probe fail cleanly as ImportError.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                       timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
