"""Run by test_fused_prefill.py with the vLLM environment's Python: FusedKV reconstruction layers built on vLLM's
CPU backend impl, over caches written by vLLM's own op, equal a float64 reference for one batch that mixes decode
rows, whole-sequence prefill chunks, prefill chunks that start mid-sequence (long and short) and a one-token
sequence, GQA, for FusedKV (two weighted K and V sources: the native path, whose long chunks take the fused SDPA
route) and Lite (K^n, V^1: vLLM's op); the native path equals the gathered one; whole-sequence chunks read the
storage layers' rows of the step, not the cache (their cache slots poisoned, the result unchanged), and only
that step's (another step's metadata reads the cache); eager rows are kept by reference, a compiled model's
copied."""

import dataclasses
from types import SimpleNamespace

import torch
from vllm import _custom_ops as ops
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.forward_context import ForwardContext, override_forward_context
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, CPUAttentionMetadata, _get_attn_isa

from fusedkv.kernels.reference import materialized_attention
from fusedkv.model.fusion import KVSources
from fusedkv.serving.paged import CrossLayerAttention, select_paths
from fusedkv.serving.paged_blocks import split_cpu_kv_cache
from fusedkv.serving.paged_native import StorageAttention

H_KV, H_Q, D, BS = 2, 4, 64, 32
# (tokens already in the cache, query tokens this step), per request
REQUESTS = [(70, 1), (0, 40), (45, 20), (0, 16), (30, 5), (33, 1), (0, 1)]
WHOLE = [r for r, (c, t) in enumerate(REQUESTS) if c == 0 and t >= 16]


def cpu_impl(dtype):
    config = VllmConfig()
    config.model_config = SimpleNamespace(dtype=dtype)  # all the impl reads of it
    with set_current_vllm_config(config):
        return CPUAttentionBackendImpl(num_heads=H_Q, head_size=D, scale=D**-0.5, num_kv_heads=H_KV, alibi_slopes=None,
                                       sliding_window=None, kv_cache_dtype="auto")


def check(dtype, compiled: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    isa = _get_attn_isa(dtype, BS, D)
    seq_lens = [c + t for c, t in REQUESTS]
    widths = [-(-s // BS) for s in seq_lens]
    num_blocks = sum(widths) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, at = [], 0
    for w in widths:
        tables.append(perm[at:at + w] + [0] * (max(widths) - w))
        at += w
    block_table = torch.tensor(tables, dtype=torch.int32)

    def slots(r, positions):
        return torch.tensor([tables[r][p // BS] * BS + p % BS for p in positions])

    # Two storage layers (layer 1 and layer n), their K/V of every position of every request.
    kv = {n: [(torch.randn(s, H_KV, D, generator=g).to(dtype), torch.randn(s, H_KV, D, generator=g).to(dtype))
              for s in seq_lens] for n in ("l0", "l1")}
    storage = {}
    for n in kv:
        # Zeros where no token was written: vLLM's op (Lite's path) reads a block's tail past the sequence
        # (weight 0, but 0 x NaN is NaN); what the native path reads is checked with NaN slots below.
        cache = torch.zeros(num_blocks, H_KV, BS, 2 * D, dtype=dtype)
        key_cache, value_cache = split_cpu_kv_cache(cache)
        for r, (c, _) in enumerate(REQUESTS):  # what earlier steps wrote
            if c:
                ops.cpu_attn_reshape_and_cache(kv[n][r][0][:c], kv[n][r][1][:c], key_cache, value_cache,
                                               slots(r, range(c)), isa)
        storage[n] = SimpleNamespace(kv_cache=cache, impl=cpu_impl(dtype), _k_scale_float=1.0, _v_scale_float=1.0,
                                     isa=isa, layer_name=n)
    k_w = [torch.rand(H_KV, D, generator=g) + 0.5 for _ in range(2)]
    v_w = [torch.rand(H_KV, D, generator=g) + 0.5 for _ in range(2)]
    fused = CrossLayerAttention(cpu_impl(dtype), ["l0", "l1"], ["l0", "l1"])
    fused.take(KVSources((), tuple(k_w), (), tuple(v_w)))  # as serving's weight loading does
    lite = CrossLayerAttention(cpu_impl(dtype), ["l1"], ["l0"])
    lite.take(KVSources((), (None,), (), (None,)))
    select_paths([fused, lite], dtype, torch.device("cpu"), BS, storage, compiled)  # as serving's loading does
    assert fused.path == "native" and fused.step_rows and lite.path == "vllm_op", (fused.path, lite.path)
    assert all(isinstance(storage[n].impl, StorageAttention) for n in storage)

    # This step: every request's new tokens, as vLLM's runner batches them.
    q_lens = [t for _, t in REQUESTS]
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    num_tokens = int(starts[-1])
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    meta = CPUAttentionMetadata(
        num_actual_tokens=num_tokens, max_query_len=max(q_lens), query_start_loc=starts, max_seq_len=max(seq_lens),
        seq_lens=seq_lens_t, block_table=block_table,
        slot_mapping=torch.cat([slots(r, range(c, c + t)) for r, (c, t) in enumerate(REQUESTS)]),
        scheduler_metadata=ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(REQUESTS), num_heads=H_Q, num_kv_heads=H_KV, head_dim=D, seq_lens=seq_lens_t, dtype=dtype,
            query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
            dynamic_causal=None, kv_cache_dtype="auto"))
    pad = 3  # rows past num_actual_tokens, as a padded batch has
    for n, m in storage.items():  # the storage layers' cache write and attention (vLLM's two custom ops)
        key, value = (torch.cat([kv[n][r][side][c:] for r, (c, _) in enumerate(REQUESTS)]
                                + [torch.randn(pad, H_KV, D).to(dtype)]) for side in (0, 1))
        m.impl.do_kv_cache_update(m, key[:num_tokens], value[:num_tokens], m.kv_cache, meta.slot_mapping)
        out = torch.empty(num_tokens + pad, H_Q, D, dtype=dtype)
        m.impl.forward(m, torch.randn(num_tokens + pad, H_Q, D).to(dtype), key, value, m.kv_cache, meta, out)
        kept = m.impl.step_rows(meta)
        assert kept is not None and kept[0].shape[0] == num_tokens
        assert (kept[0].data_ptr() == key.data_ptr()) != compiled, "eager rows by reference, compiled rows copied"
        assert torch.equal(kept[0], key[:num_tokens]) and torch.equal(kept[1], value[:num_tokens])

    query = torch.randn(num_tokens + pad, H_Q, D, generator=g).to(dtype)
    layer = SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0)

    def run(impl, step_meta=meta):
        output = torch.full_like(query, float("nan"))
        with override_forward_context(ForwardContext(no_compile_layers=storage, attn_metadata={}, slot_mapping={})):
            impl.forward(layer, query, None, None, None, step_meta, output)
        return output[:num_tokens]

    def reference(k_src, kw, v_src, vw):
        """float64, per request: fused K/V materialised from the tokens as stored, causal rows."""
        rows = []
        for r, (c, t) in enumerate(REQUESTS):
            s = c + t
            ks = [kv[n][r][0].double().transpose(0, 1)[None] for n in k_src]
            vs = [kv[n][r][1].double().transpose(0, 1)[None] for n in v_src]
            qr = query[starts[r]:starts[r + 1]].double().transpose(0, 1)[None]
            mask = torch.arange(s)[None, :] <= torch.arange(c, s)[:, None]
            rows.append(materialized_attention(qr, ks, kw, vs, vw, mask=mask, scale=D**-0.5)[0].transpose(0, 1))
        return torch.cat(rows)

    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    want = reference(["l0", "l1"], [w.double() for w in k_w], ["l0", "l1"], [w.double() for w in v_w])
    native = run(fused)
    torch.testing.assert_close(native.double(), want, **tol)
    torch.testing.assert_close(run(lite).double(), reference(["l1"], None, ["l0"], None), **tol)
    fused.use("gathered", fused.layout, fused.step_rows)  # the gathered route: every row from copied blocks
    torch.testing.assert_close(run(fused), native, **tol)
    fused.use("native", fused.layout, True)

    # The whole-sequence chunks read the rows of the step: poison their cache slots, nothing changes ...
    whole_rows = torch.cat([torch.arange(starts[r], starts[r + 1]) for r in WHOLE])
    for m in storage.values():
        key_cache, value_cache = split_cpu_kv_cache(m.kv_cache)
        for r in WHOLE:
            for b in tables[r][:widths[r]]:
                key_cache[b].fill_(float("nan"))
                value_cache[b].fill_(float("nan"))
    assert torch.equal(run(fused), native)
    # ... and only the step's own: with another metadata object the chunks read the (poisoned) cache.
    other = run(fused, dataclasses.replace(meta))
    assert not other[whole_rows].isfinite().any()
    rest = torch.ones(num_tokens, dtype=torch.bool)
    rest[whole_rows] = False
    torch.testing.assert_close(other[rest], native[rest], **tol)
    print(dtype, "compiled" if compiled else "eager", "ok")


for dtype in (torch.float32, torch.bfloat16):
    for compiled in (False, True):
        check(dtype, compiled, seed=len(str(dtype)) + compiled)
print("ALL OK")
