"""Attention of reconstruction layers over other layers' paged KV caches (paper Sec. 3.2, Eq. 4-5).

A reconstruction layer i attends over

    K^i = sum_s a_s (.) K^s        V^i = sum_s b_s (.) V^s

built from storage layers' post-RoPE caches (a weight of None: plain reuse). In vLLM the layer is an
`Attention` with `kv_sharing_target_layer_name` (so it owns no cache blocks) whose `impl` is replaced
by `CrossLayerAttention`, which reads the source layers' cache tensors from the forward context.
Nothing fused is ever written; the factored identity (paper Sec. 3.3) moves the fusion weights:

    q . (sum_s a_s (.) k_s) = sum_s (a_s (.) q) . k_s        P (sum_s b_s (.) V_s) = sum_s b_s (.) (P V_s)

Two ways to evaluate it, chosen once per layer from its plan entry:

  * one K source (YOCO-like reuse with another V, Lite, single-source scaling, reversed maps): vLLM's
    own CPU attention op, called with the K source's key cache and each V source's value cache (the op
    takes them as separate arguments), on the query times a_s; the outputs are summed with weights
    b_s. Lite is one op call over (K^n, V^1): no copies at all.
  * two or more K sources (FusedKV, dense fusion): softmax needs one score matrix over all K sources,
    which no single call of the op computes, so the blocks of each sequence are gathered into
    contiguous tensors and `fusedkv.kernels.reference.factored_attention` runs on them (decode steps
    batched, prefill chunks per sequence). Correct and simple; it copies the gathered blocks.

The CPU backend stores blocks in its own layout (the "vec" ISA keeps each key block transposed,
[head_dim, block]); `block_layout` learns the layout from the backend's own cache-write op instead of
assuming it, so the gather is right for every ISA the op has.
"""

from __future__ import annotations

import functools

import torch

from ..kernels.reference import factored_attention


def split_cpu_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[blocks, kv_heads, block, 2*D] -> key cache, value cache, each [blocks, kv_heads, block, D] (views),
    exactly as vLLM's CPU backend splits it."""
    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    return kv_cache.view(num_blocks, num_kv_heads, block_size * 2, -1).chunk(2, dim=2)


@functools.lru_cache(maxsize=16)
def block_layout(isa: str, dtype: torch.dtype, block_size: int, head_dim: int) -> tuple[torch.Tensor | None, ...]:
    """Where the CPU backend puts element (token t, channel d) of one (block, head) of the key and of
    the value cache: index tensors `idx` with plain[t * D + d] = raw[idx[t * D + d]] (None = plain).

    Learned by writing position codes through vLLM's `cpu_attn_reshape_and_cache` into a scratch cache
    of one block and one head. Codes are written in base-64 digits, exact in every cache dtype."""
    from vllm import _custom_ops as ops

    n = block_size * head_dim
    base, digits = 64, 1
    while base**digits < n:
        digits += 1
    codes = torch.arange(n)
    found = [torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)]
    for k in range(digits):
        digit = (codes // base**k) % base
        tokens = digit.view(block_size, 1, head_dim).to(dtype)  # [T, H=1, D], token t = slot t
        kv = torch.zeros(1, 1, block_size, 2 * head_dim, dtype=dtype)
        key_cache, value_cache = split_cpu_kv_cache(kv)
        ops.cpu_attn_reshape_and_cache(tokens, tokens.clone(), key_cache, value_cache,
                                       torch.arange(block_size), isa)
        for side, cache in enumerate((key_cache, value_cache)):
            found[side] += cache[0, 0].reshape(-1).to(torch.long) * base**k
    layout = []
    for raw_codes in found:
        # raw position p holds code raw_codes[p]; invert to: code c sits at position idx[c].
        if not torch.equal(torch.sort(raw_codes).values, codes):
            raise RuntimeError(f"vLLM's CPU cache layout for isa={isa!r} is not a permutation of one block; "
                               "the gathered attention path cannot read it")
        idx = torch.empty(n, dtype=torch.long)
        idx[raw_codes] = torch.arange(n)
        transposed = torch.arange(n).view(block_size, head_dim).t().reshape(-1)  # raw [D, bs] holds (t, d)
        layout.append(None if torch.equal(idx, codes) else TRANSPOSED if torch.equal(raw_codes, transposed) else idx)
    return tuple(layout)


TRANSPOSED = "transposed"  # each (block, head) stored [head_dim, block]: the "vec" ISA's key layout


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, layout) -> torch.Tensor:
    """Blocks [R, n] of a [num_blocks, H, bs, D] cache -> [R, H, n * bs, D] in token order (a strided
    view of one copy for the plain and transposed layouts)."""
    r, n = blocks.shape
    num_blocks, h, bs, d = cache.shape
    if layout is None:  # [H, R, n, bs, D]: one copy; the result is a view of it
        return cache.transpose(0, 1)[:, blocks].view(h, r, n * bs, d).transpose(0, 1)
    if isinstance(layout, str):  # TRANSPOSED: [H, R, n, D, bs] copy, then tokens to the front
        x = cache.view(num_blocks, h, d, bs).transpose(0, 1)[:, blocks]
        return x.permute(1, 0, 2, 4, 3).reshape(r, h, n * bs, d)
    x = cache[blocks.reshape(-1)].reshape(r * n, h, bs * d).index_select(-1, layout)
    return x.view(r, n, h, bs, d).permute(0, 2, 1, 3, 4).reshape(r, h, n * bs, d)


class CrossLayerAttention:
    """Stands in for a reconstruction layer's backend `impl` (see the module docstring).

    `k_layers` / `v_layers`: attention-layer names of the sources; `weights()` returns the current
    per-source fusion weights ([H_kv, D] tensors or None), K then V lists."""

    def __init__(self, base_impl, k_layers: list[str], v_layers: list[str], weights):
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        if not isinstance(base_impl, CPUAttentionBackendImpl):
            raise NotImplementedError(
                f"FusedKV reconstruction layers that read two different layers (Lite, FusedKV, custom source "
                f"maps) run on vLLM's CPU attention backend in this version, not on {type(base_impl).__name__}; "
                "plans whose upper layers reuse one layer's K and V (vanilla, GQA, CLA, YOCO) run on any backend")
        if base_impl.kv_cache_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise NotImplementedError(
                f"kv_cache_dtype={base_impl.kv_cache_dtype!r}: FusedKV reconstruction layers read unquantised caches; "
                "serve with the default --kv-cache-dtype auto")
        self.base = base_impl
        self.k_layers, self.v_layers = list(k_layers), list(v_layers)
        self.weights = weights
        self.gathered = len(self.k_layers) > 1

    def __getattr__(self, name):  # backend attributes the runner reads (sliding_window, scale, ...)
        return getattr(self.base, name)

    def process_weights_after_loading(self, act_dtype):
        self.base.process_weights_after_loading(act_dtype)

    # ---- the impl interface ---------------------------------------------------------------------
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantisation is not supported by FusedKV layers")
        if attn_metadata is None:  # profiling / warm-up run: no cache yet
            return output
        from vllm.forward_context import get_forward_context

        layers = get_forward_context().no_compile_layers
        keys = [split_cpu_kv_cache(layers[n].kv_cache)[0] for n in self.k_layers]
        values = [split_cpu_kv_cache(layers[n].kv_cache)[1] for n in self.v_layers]
        k_weights, v_weights = self.weights()
        t = attn_metadata.num_actual_tokens
        q, out = query[:t], output[:t]
        if self.gathered:
            self._gathered(layer, q, keys, k_weights, values, v_weights, attn_metadata, out)
        else:
            self._with_cpu_op(layer, q, keys[0], k_weights[0], values, v_weights, attn_metadata, out)
        return output

    # ---- one K source: vLLM's op, once per V source ---------------------------------------------
    def _with_cpu_op(self, layer, q, key_cache, k_weight, values, v_weights, meta, out):
        from vllm import _custom_ops as ops

        h_kv = key_cache.shape[1]
        if k_weight is not None:  # key fusion on the query: (a (.) q) . k
            t, h, d = q.shape
            q = (q.view(t, h_kv, h // h_kv, d) * k_weight[None, :, None, :].to(q.dtype)).view(t, h, d)
        for i, (value_cache, w) in enumerate(zip(values, v_weights)):
            target = out if i == 0 and w is None else torch.empty_like(out)
            ops.cpu_attention_with_kv_cache(
                query=q.contiguous(), key_cache=key_cache, value_cache=value_cache, output=target,
                query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens, scale=self.base.scale,
                causal=meta.causal, alibi_slopes=self.base.alibi_slopes, sliding_window=self.base.sliding_window,
                block_table=meta.block_table, softcap=self.base.logits_soft_cap,
                scheduler_metadata=meta.scheduler_metadata, s_aux=self.base.sinks,
                dynamic_causal=meta.dynamic_causal, k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
                kv_cache_dtype=self.base.kv_cache_dtype)
            if target is out:
                continue
            if w is not None:  # value fusion on the output: b (.) (P V)
                t, h, d = target.shape
                target = (target.view(t, h_kv, h // h_kv, d) * w[None, :, None, :].to(target.dtype)).view(t, h, d)
            if i == 0:
                out.copy_(target)
            else:
                out.add_(target)

    # ---- several K sources: gather each sequence's blocks, factored attention -------------------
    def _gathered(self, layer, q, keys, k_weights, values, v_weights, meta, out):
        block_size, head_dim = keys[0].shape[2], keys[0].shape[3]
        key_layout, value_layout = block_layout(layer.isa, keys[0].dtype, block_size, head_dim)
        starts = meta.query_start_loc.tolist()
        num_reqs = len(starts) - 1
        seq_lens = meta.seq_lens[:num_reqs].tolist()
        decodes = [r for r in range(num_reqs) if starts[r + 1] - starts[r] == 1]
        if decodes:
            # One-token steps, batched: pad to the longest sequence and mask the tail.
            rows = torch.tensor(decodes)
            lens = meta.seq_lens[rows]
            n_blocks = -(-max(seq_lens[r] for r in decodes) // block_size)
            blocks = meta.block_table[rows, :n_blocks]
            k_src = [gather_blocks(c, blocks, key_layout) for c in keys]
            v_src = [gather_blocks(c, blocks, value_layout) for c in values]
            mask = torch.arange(n_blocks * block_size)[None, :] < lens[:, None]  # [R, S]
            token_rows = torch.tensor([starts[r] for r in decodes])
            o = factored_attention(q[token_rows].unsqueeze(2), k_src, k_weights, v_src, v_weights,  # [R, H, 1, D]
                                   mask=mask[:, None, None, :], scale=self.base.scale)
            out[token_rows] = o[:, :, 0].to(out.dtype)
        for r in range(num_reqs):
            t = starts[r + 1] - starts[r]
            if t <= 1:
                continue
            s = seq_lens[r]
            blocks = meta.block_table[r:r + 1, : -(-s // block_size)]
            k_src = [gather_blocks(c, blocks, key_layout)[:, :, :s] for c in keys]
            v_src = [gather_blocks(c, blocks, value_layout)[:, :, :s] for c in values]
            # Query i of this chunk sits at position s - t + i and sees keys 0 .. s - t + i.
            mask = torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]
            qr = q[starts[r]:starts[r + 1]].transpose(0, 1).unsqueeze(0)  # [1, H, t, D]
            o = factored_attention(qr, k_src, k_weights, v_src, v_weights, mask=mask, scale=self.base.scale)
            out[starts[r]:starts[r + 1]] = o[0].transpose(0, 1).to(out.dtype)
