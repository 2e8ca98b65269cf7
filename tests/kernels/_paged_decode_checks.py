"""Checks of the paged decode kernel and of a vLLM batch over paged caches, on any device: the Triton
interpreter runs them on CPU (`_triton_paged_interpret_cases.py`), `test_triton_paged_decode.py` on CUDA.

The reference is built independently of the code under test: every sequence's blocks are copied out of
the paged caches into contiguous float64 tensors, the fused K and V are materialised
(K = sum_s a_s (.) K_s, V = sum_s b_s (.) V_s, paper Sec. 2.2, Eqs. 4-5) and plain softmax attention
runs on them, with the causal mask (and a sliding window: a query at p sees keys p - W < k <= p, the
model's convention) and Gemma 2's soft cap on the scaled scores. Cache blocks that no sequence owns, and
the slots past each sequence's end, hold NaN: a key the kernel reads but should not shows up as NaN in
its output (`poison_left_of_window` does the same to the keys left of every query's window).
"""

from __future__ import annotations

import torch

D, BLOCK = 16, 16


def make_paged(seq_lens, h_kv, g, n_k, n_v, weighted, *, dtype=torch.float32, device="cpu", vllm_strides=True,
               d=D, seed=0, spare_blocks=3, query_lens=None):
    """Random paged sources: caches [num_blocks, BLOCK, H_kv, d] for n_k K and n_v V layers, a shuffled
    block table, queries for `query_lens[r]` tokens per request (default 1)."""
    gen = torch.Generator().manual_seed(seed)
    query_lens = [1] * len(seq_lens) if query_lens is None else query_lens
    need = [-(-s // BLOCK) for s in seq_lens]
    max_blocks = max(need) + 1  # one unused column: its entries point at nothing valid
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(seq_lens), max_blocks), 10**6, dtype=torch.int32)  # far out of range if read
    used = 0
    for r, n in enumerate(need):
        table[r, :n] = perm[used:used + n].to(torch.int32)
        used += n

    def cache_pair():
        # vLLM's GPU backends hold [num_blocks, H_kv, BLOCK, 2 * d] and view it as two strided caches.
        if vllm_strides:
            kv = torch.full((num_blocks, h_kv, BLOCK, 2 * d), float("nan"), dtype=torch.float64)
            return list(kv.transpose(1, 2).split(d, dim=-1)), kv
        return [torch.full((num_blocks, BLOCK, h_kv, d), float("nan"), dtype=torch.float64) for _ in range(2)], None

    layers = [cache_pair() for _ in range(max(n_k, n_v) + 1)]
    for (k, v), _ in layers:  # real tokens in the owned slots only
        for r, s in enumerate(seq_lens):
            for t in range(s):
                blk, slot = int(table[r, t // BLOCK]), t % BLOCK
                k[blk, slot] = torch.randn(h_kv, d, generator=gen, dtype=torch.float64)
                v[blk, slot] = torch.randn(h_kv, d, generator=gen, dtype=torch.float64)
    # K sources from layers 1.., V sources from layers 0..: with n_k = n_v = 1 it is Lite (K^n, V^1).
    key_caches = [layers[1 + i][0][0] for i in range(n_k)]
    value_caches = [layers[i][0][1] for i in range(n_v)]
    kw = [torch.randn(h_kv, d, generator=gen, dtype=torch.float64) if weighted else None for _ in range(n_k)]
    vw = [torch.randn(h_kv, d, generator=gen, dtype=torch.float64) if weighted else None for _ in range(n_v)]
    q = torch.randn(sum(query_lens), h_kv * g, d, generator=gen, dtype=torch.float64)

    def low(x):
        return x.to(device=device, dtype=dtype)

    if vllm_strides:  # cast the whole [.., 2 * d] tensor, then split, so the strides stay vLLM's
        full = {id(kv): kv.to(device=device, dtype=dtype) for _, kv in layers}
        splits = {id(kv): full[id(kv)].transpose(1, 2).split(d, dim=-1) for _, kv in layers}
        key_dev = [splits[id(layers[1 + i][1])][0] for i in range(n_k)]
        value_dev = [splits[id(layers[i][1])][1] for i in range(n_v)]
    else:
        key_dev, value_dev = [low(c) for c in key_caches], [low(c) for c in value_caches]
    # Per layer (index 0..): the whole vLLM cache tensor [num_blocks, H_kv, BLOCK, 2 * d] on the device.
    dev_layers = [full[id(kv)] for _, kv in layers] if vllm_strides else None
    dev = dict(q=low(q), layers=dev_layers, key_caches=key_dev,
               k_weights=[None if w is None else low(w).float() for w in kw], value_caches=value_dev,
               v_weights=[None if w is None else low(w).float() for w in vw],
               block_table=table.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device))
    # The reference sees the values the device tensors hold (rounded to `dtype`), in float64.
    ref = dict(q=low(q).double().cpu(), key_caches=[c.double().cpu() for c in key_dev], k_weights=kw,
               value_caches=[c.double().cpu() for c in value_dev], v_weights=vw, block_table=table,
               seq_lens=list(seq_lens), query_lens=list(query_lens))
    return dev, ref


def _fuse(caches, weights, blocks, s) -> torch.Tensor:
    """sum_w w (.) X over the sequence's blocks copied out in token order: [H_kv, s, D]."""
    def contiguous(cache):
        return cache[blocks].reshape(-1, cache.shape[2], cache.shape[3])[:s].transpose(0, 1)

    return sum(contiguous(c) * (1.0 if w is None else w[:, None, :]) for c, w in zip(caches, weights))


def poison_left_of_window(dev, ref, window) -> None:
    """NaN into the device caches' slots that no query of a request sees under a window of W (keys before
    s - t - W + 1 for t query tokens over s keys): blocks a window layer frees hold anything. The reference
    keeps its copies (it masks those keys)."""
    caches = {id(c): c for c in (*dev["key_caches"], *dev["value_caches"])}.values()
    for r, (s, t) in enumerate(zip(ref["seq_lens"], ref["query_lens"])):
        for pos in range(max(s - t - window + 1, 0)):
            blk, slot = int(ref["block_table"][r, pos // BLOCK]), pos % BLOCK
            for c in caches:
                c[blk, slot] = float("nan")


def reference(ref, scale=None, window=None, softcap=None) -> torch.Tensor:
    """Float64 attention per request with materialised fused K/V; query token i of a request with t query
    tokens and s keys sits at position s - t + i (causal; with a `window` W it sees keys p - W < k <= p).
    `softcap` c: scores -> c tanh(scores / c) after the scale. Returns [T, H_q, D]."""
    q = ref["q"]
    h_q, d = q.shape[1], q.shape[2]
    scale = d ** -0.5 if scale is None else scale
    outs, row = [], 0
    for r, (s, t) in enumerate(zip(ref["seq_lens"], ref["query_lens"])):
        blocks = ref["block_table"][r, : -(-s // BLOCK)].long()
        k = _fuse(ref["key_caches"], ref["k_weights"], blocks, s)
        v = _fuse(ref["value_caches"], ref["v_weights"], blocks, s)
        g = h_q // k.shape[0]
        k, v = k.repeat_interleave(g, dim=0), v.repeat_interleave(g, dim=0)
        qr = q[row:row + t].transpose(0, 1)  # [H_q, t, D]
        scores = scale * qr @ k.transpose(1, 2)  # [H_q, t, s]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos, k_pos = torch.arange(s - t, s)[:, None], torch.arange(s)[None, :]
        causal = k_pos <= q_pos
        if window:
            causal &= q_pos - k_pos < window
        if s == 0:
            outs.append(torch.zeros(t, h_q, d, dtype=torch.float64))
        else:
            p = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
            outs.append((p @ v).transpose(0, 1))
        row += t
    return torch.cat(outs)


def max_error(out, ref_out) -> float:
    return (out.double().cpu() - ref_out).abs().max().item()


def check_kernel(seq_lens, h_kv, g, n_k, n_v, weighted, device, *, dtype=torch.float32, num_splits=None,
                 vllm_strides=True, tol=1e-5, seed=0, d=D, scale=None, window=None, softcap=None, **launch):
    """The kernel against `reference`; with a `window`, the keys left of it hold NaN (never read)."""
    from fusedkv.kernels.triton_paged_decode import paged_decode_attention

    dev, ref = make_paged(seq_lens, h_kv, g, n_k, n_v, weighted, dtype=dtype, device=device,
                          vllm_strides=vllm_strides, seed=seed, d=d)
    if window:
        poison_left_of_window(dev, ref, window)
    out = paged_decode_attention(dev["q"], dev["key_caches"], dev["k_weights"], dev["value_caches"],
                                 dev["v_weights"], dev["block_table"], dev["seq_lens"], scale, num_splits=num_splits,
                                 window=window, softcap=softcap, **launch)
    assert out.shape == dev["q"].shape and out.dtype == dtype
    want = reference(ref, scale, window, softcap)
    err = max_error(out, want) / (want.abs().max().item() if dtype != torch.float32 else 1.0)
    assert err < tol, (seq_lens, h_kv, g, n_k, n_v, weighted, dtype, num_splits, window, softcap, err)
    return out, ref


def check_batch(seq_lens, query_lens, h_kv, g, n_k, n_v, weighted, device, *, use_kernel, dtype=torch.float32,
                tol=1e-5, scale=None, window=None, softcap=None):
    """`paged_cross_layer_attention` over a vLLM batch (decode rows and prefill chunks mixed); with a `window`,
    the keys left of every query's window hold NaN (never read)."""
    from fusedkv.serving.paged_triton import paged_cross_layer_attention

    dev, ref = make_paged(seq_lens, h_kv, g, n_k, n_v, weighted, dtype=dtype, device=device,
                          query_lens=query_lens, seed=1)
    if window:
        poison_left_of_window(dev, ref, window)
    scale = dev["q"].shape[-1] ** -0.5 if scale is None else scale
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    out = torch.full_like(dev["q"], float("nan"))
    paged_cross_layer_attention(dev["q"], dev["key_caches"], dev["k_weights"], dev["value_caches"], dev["v_weights"],
                                starts, dev["seq_lens"], dev["block_table"], scale, out=out,
                                max_query_len=max(query_lens), window=window, softcap=softcap, use_kernel=use_kernel)
    err = max_error(out, reference(ref, scale, window, softcap))
    assert err < tol, (seq_lens, query_lens, use_kernel, window, softcap, err)
    return out, ref
