"""FusedKV's prefill route in vLLM (`fusedkv.serving.paged_native`): long prefill chunks of two-source reconstruction
layers attend over their fused K/V in the model's reference attention (`paged_gathered.attend_chunk`), a
whole-sequence chunk over the storage layers' rows of the step (`StorageAttention`), and equal the reference.

Here, in float64 and the project's environment: `attend_chunk` on random sources against the plain
reference (materialised fused K/V, explicit causal mask), for whole-sequence chunks and chunks that start
mid-sequence, GQA, FusedKV's two weighted sources and Lite's reuse. `_fused_prefill_cases.py`, run by the
session's vLLM worker: the layers on vLLM's CPU backend impl over caches its own op wrote, a mixed batch."""

from pathlib import Path

import pytest
import torch

from fusedkv.kernels.reference import materialized_attention
from fusedkv.model.attention import ReferenceAttention
from fusedkv.model.fusion import KVSources
from fusedkv.serving.paged_gathered import attend_chunk


def fused_chunk_attention(q, keys, kw, values, vw, scale, window=None, softcap=None):
    """A prefill chunk q [t, H_q, D] over [s, H_kv, D] sources as a served layer attends it: `attend_chunk` in the
    model's `ReferenceAttention`."""
    s, h_kv = keys[0].shape[:2]
    sources = KVSources(tuple(k.transpose(0, 1)[None] for k in keys), tuple(kw),
                        tuple(v.transpose(0, 1)[None] for v in values), tuple(vw))
    return attend_chunk(q, sources, s, 0, ReferenceAttention(scale, q.shape[1] != h_kv, softcap), window)


@pytest.mark.parametrize("h_q,h_kv", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("plan", ["fusedkv", "lite"])
@pytest.mark.parametrize("t,s", [(37, 37), (16, 16), (20, 57), (16, 17)], ids=["whole", "whole16", "mid", "mid1"])
def test_fused_chunk_attention_equals_the_reference(h_q, h_kv, plan, t, s):
    g = torch.Generator().manual_seed(h_q * 100 + t + s)
    d = 32
    src = [torch.randn(s, h_kv, d, generator=g, dtype=torch.float64) for _ in range(4)]
    if plan == "fusedkv":  # K = a1 K^1 + an K^n, V = b1 V^1 + bn V^n
        keys, values = src[:2], src[2:]
        kw = [torch.rand(h_kv, d, generator=g, dtype=torch.float64) + 0.5 for _ in range(2)]
        vw = [torch.rand(h_kv, d, generator=g, dtype=torch.float64) + 0.5 for _ in range(2)]
    else:  # Lite: K^n and V^1 as they are
        keys, values, kw, vw = src[1:2], src[2:3], [None], [None]
    # Strided sources, as the storage layers' rows of a step are (slices of the batch, V a view of the QKV output).
    keys = [torch.cat([k, k], dim=-1)[..., :d] for k in keys]
    q = torch.randn(t, h_q, d, generator=g, dtype=torch.float64)
    got = fused_chunk_attention(q, keys, kw, values, vw, scale=d**-0.5)
    mask = torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]  # query i at position s - t + i
    want = materialized_attention(q.transpose(0, 1)[None], [k.transpose(0, 1)[None] for k in keys], kw,
                                  [v.transpose(0, 1)[None] for v in values], vw, mask=mask, scale=d**-0.5)
    torch.testing.assert_close(got, want[0].transpose(0, 1), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("window,softcap", [(5, None), (None, 3.0), (7, 2.0), (1, None)],
                         ids=["window", "softcap", "both", "window1"])
@pytest.mark.parametrize("t,s", [(24, 24), (16, 40)], ids=["whole", "mid"])
def test_fused_chunk_attention_windows_and_soft_caps(window, softcap, t, s):
    """Gemma 2 / window hybrids: a query at p sees keys p - W < k <= p, scores c tanh(score / c), written out
    plainly here (fused K/V, heads repeated, explicit mask and softmax) in float64."""
    g = torch.Generator().manual_seed(t + s + (window or 0))
    h_q, h_kv, d = 4, 2, 16
    keys = [torch.randn(s, h_kv, d, generator=g, dtype=torch.float64) for _ in range(2)]
    values = [torch.randn(s, h_kv, d, generator=g, dtype=torch.float64) for _ in range(2)]
    kw = [torch.rand(h_kv, d, generator=g, dtype=torch.float64) + 0.5 for _ in range(2)]
    vw = [torch.rand(h_kv, d, generator=g, dtype=torch.float64) + 0.5 for _ in range(2)]
    q = 3 * torch.randn(t, h_q, d, generator=g, dtype=torch.float64)  # large scores: the cap bites
    got = fused_chunk_attention(q, keys, kw, values, vw, scale=d**-0.5, window=window, softcap=softcap)
    k = (kw[0] * keys[0] + kw[1] * keys[1]).repeat_interleave(h_q // h_kv, dim=1)  # [s, H_q, D]
    v = (vw[0] * values[0] + vw[1] * values[1]).repeat_interleave(h_q // h_kv, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * d**-0.5
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos, key_pos = torch.arange(s - t, s)[:, None], torch.arange(s)[None, :]
    mask = (key_pos <= q_pos) & (q_pos - key_pos < (window or s + 1))
    want = torch.einsum("hts,shd->thd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)
    # A capped layer's softmax runs in float32, as the model's (and transformers' eager Gemma 2) does.
    tol = 1e-6 if softcap else 1e-12
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    plain = fused_chunk_attention(q, keys, kw, values, vw, scale=d**-0.5)  # the window / cap change the answer
    assert (plain - want).abs().max() > 1e-3


@pytest.mark.slow  # vLLM's CPU backend and its cache writes, in the vLLM environment: the full suite's
def test_prefill_route_on_vllm_cpu_backend_equals_the_reference(vllm_workers):
    r = vllm_workers.run(script=str(Path(__file__).with_name("_fused_prefill_cases.py")), timeout=600)
    assert r["rc"] == 0 and "ALL OK" in r["stdout"], r["stdout"][-2000:] + r["log"][-2000:] + r["error"][-2000:]
