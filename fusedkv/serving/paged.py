"""Attention of reconstruction layers over other layers' paged KV caches (paper Sec. 3.2, Eq. 4-5).

A reconstruction layer i attends over

    K^i = sum_s a_s (.) K^s        V^i = sum_s b_s (.) V^s

built from storage layers' post-RoPE caches (a weight of None: plain reuse). In vLLM the layer is an
`Attention` with `kv_sharing_target_layer_name` (so it owns no cache blocks) whose `impl` is replaced
by `CrossLayerAttention`, which reads the source layers' cache tensors from the forward context.
Nothing fused is ever written; the factored identity (paper Sec. 3.3) moves the fusion weights:

    q . (sum_s a_s (.) k_s) = sum_s (a_s (.) q) . k_s        P (sum_s b_s (.) V_s) = sum_s b_s (.) (P V_s)

The ways to evaluate it, chosen once per layer by the engine's selection
(`fusedkv.engine.selection.select_paged_attention`), which serving's weight loading asks through
`select_paths`; nothing re-checks per call:

  * one K source (YOCO-like reuse with another V, Lite, single-source scaling, reversed maps): vLLM's
    own CPU attention op, called with the K source's key cache and each V source's value cache (the op
    takes them as separate arguments), on the query times a_s; the outputs are summed with weights
    b_s. Lite is one op call over (K^n, V^1): no copies at all.
  * two K sources (FusedKV, the iterative variant): softmax needs one score matrix over the SUM of the
    sources' scores, which no call of the op computes (nor per-source calls merged by log-sum-exp: those
    are separate softmaxes). The native kernel `cpu_paged_attention.c` reads every source's blocks in
    place through the block table, decode rows and short prefill chunks in one call (`native_paged_attention`).
    Prefill chunks of `PREFILL_ROWS` or more rows attend as a normal layer's prefill does: the chunk's fused
    K^i, V^i are built (one weighted sum per side) and attended in one causal SDPA call
    (`fused_chunk_attention`; the factored form pays off only for a few query rows). A chunk that is its whole
    sequence (it starts at position 0: no chunked prefill, no prefix-cache hit) takes its source rows from the
    storage layers' own inputs of this step, post-RoPE as they were written to the cache (`StorageAttention`),
    so nothing is read back from the cache; a chunk that starts mid-sequence gathers its blocks.
  * where that kernel does not apply (no C compiler, more than two sources as in dense fusion, a block layout
    it does not read): the blocks of each sequence are gathered into contiguous tensors and
    `fusedkv.kernels.reference.factored_attention` runs on them. Correct and simple; it copies.

On a GPU backend (vLLM's FlashAttention or Triton backend: caches [num_blocks, block_size, H_kv, D]) every
plan that reads other layers goes through `paged_cross_layer_attention`: decode rows in one launch of the paged
Triton kernel (`fusedkv.kernels.triton_paged_decode`, which reads the source blocks in place through the block
table), prefill chunks gathered per sequence into `factored_attention` with the causal mask.

An 8-bit cache (`--kv-cache-dtype fp8`, `fp8_e4m3`, `fp8_e5m2`) holds fp8(x / scale) per source layer, with one
scale for its keys and one for its values: every path reads the codes in place as fp8 (the native kernel and the
Triton kernel decode them as loaded; a gathered copy is widened), and since the sources enter Eq. 4-5 linearly, each
source's scale is folded into its fusion weight once per call (`with_scales`); vLLM's op (one K source) takes the
source layers' scales itself.

Every path, CPU and GPU, takes the layer's sliding window (a query at p sees keys p - W < k <= p; the kernels
read no block left of it) and Gemma 2's soft cap (c tanh(s / c) on the fused scores, which the factored form of
Sec. 3.3 forms before the softmax); on GPU, ALiBi and attention sinks are refused.

How each backend lays out its cache blocks (on CPU, learned from vLLM's own cache-write op), how the caches are
split into keys and values and how a sequence's blocks are gathered: `fusedkv.serving.paged_blocks`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..kernels import native
from ..kernels.reference import factored_attention, fuse_sources, merge_duplicate_sources
from .paged_blocks import (
    FP8_FORMATS,
    GPU_PAGED_IMPLS,
    cache_element_dtype,
    cpu_cache_layout,
    gather_blocks,
    gather_paged,
    kernel_layout,
    split_cpu_kv_cache,
    split_gpu_kv_cache,
)

# Prefill chunks of at least this many rows attend over their fused K/V with SDPA (`fused_chunk_attention`) instead
# of in the native kernel, which works one query row at a time and re-reads the sequence for every row; from about
# this many rows on, materialising is also faster than the factored form (the engine's threshold,
# `fusedkv.model.attention.SHORT_QUERY`). Figures: docs/serving.md, "FusedKV's prefill as a normal layer's".
PREFILL_ROWS = 16


def fused_chunk_attention(q: torch.Tensor, keys: list[torch.Tensor], k_weights: list, values: list[torch.Tensor],
                          v_weights: list, scale: float, window: int | None = None,
                          softcap: float | None = None) -> torch.Tensor:
    """One prefill chunk of t query rows over its sequence's s source rows: the fused K/V built (paper Eq. 4-5),
    then one SDPA call, causal, GQA without copies; the model's own computation for long blocks
    (`fusedkv.model.attention.ReferenceAttention`), in q's dtype.

    q [t, H_q, D]; sources [s, H_kv, D] (any strides) in token order; weights [H_kv, D] or None. Query i sits at
    position s - t + i: a whole sequence (t == s) is SDPA's causal flag, which skips the masked blocks; a chunk
    that starts mid-sequence takes the mask. A window layer's query at p sees keys p - W < k <= p; a soft cap
    (Gemma 2) is c tanh(score / c) before the softmax, which SDPA has not: those layers take the factored
    reference on the fused K/V instead. Returns [t, H_q, D]."""
    t, h_q, _ = q.shape
    s, h_kv, _ = keys[0].shape
    k = fuse_sources([x.transpose(0, 1)[None] for x in keys], k_weights, q.dtype)  # [1, H_kv, s, D]
    v = fuse_sources([x.transpose(0, 1)[None] for x in values], v_weights, q.dtype)
    mask = None
    if t != s or window or softcap:  # SDPA's causal flag serves the plain whole-sequence case alone
        q_pos, key_pos = torch.arange(s - t, s, device=q.device)[:, None], torch.arange(s, device=q.device)[None, :]
        mask = key_pos <= q_pos
        if window:
            mask &= q_pos - key_pos < window
    if softcap:
        o = factored_attention(q.transpose(0, 1)[None], [k], [None], [v], [None], mask=mask, scale=scale,
                               softcap=softcap)
        return o[0].transpose(0, 1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask, is_causal=mask is None,
                                       scale=scale, enable_gqa=h_q != h_kv)
    return o[0].transpose(0, 1)


def with_scales(weights: list, scales: list[float], h_kv: int, d: int, device) -> list:
    """Per-source fusion weights [H_kv, D] (or None) with each source cache's dequantisation scale folded in: an
    8-bit cache holds x / scale, and w (.) x = (w * scale) (.) code. A scale of 1 leaves the weight as it is."""
    out = []
    for w, scale in zip(weights, scales):
        if scale == 1.0:
            out.append(w)
        elif w is None:
            out.append(torch.full((h_kv, d), float(scale), device=device))
        else:
            out.append(w.float() * scale)
    return out


def widened(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A gathered copy of cache blocks in `dtype` where the cache holds fp8 codes (the reference kernels' dtypes)."""
    return x.to(dtype) if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else x


# ---- CPU: the native kernel over the blocks in place --------------------------------------------------
def query_rows(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int):
    """For each query token of a vLLM batch: its request (block-table row) and how many keys it sees
    (a prefill chunk's token i of t, in a sequence of s, sees s - t + i + 1)."""
    num_reqs = query_start_loc.shape[0] - 1
    one_each = torch.arange(num_reqs + 1, dtype=query_start_loc.dtype)
    if num_tokens == num_reqs and torch.equal(query_start_loc, one_each):  # decode only: row r is request r
        return one_each[:-1].to(torch.int32), seq_lens[:num_reqs].to(torch.int32).contiguous()
    starts = query_start_loc.to(torch.long)
    q_lens = starts[1:] - starts[:-1]
    row_seq = torch.repeat_interleave(torch.arange(num_reqs), q_lens)
    if row_seq.numel() != num_tokens:
        raise ValueError(f"the batch's query lengths add up to {row_seq.numel()} tokens, not {num_tokens}")
    pos = torch.arange(num_tokens) - starts[:-1][row_seq]
    row_len = seq_lens[:num_reqs].to(torch.long)[row_seq] - q_lens[row_seq] + pos + 1
    return row_seq.to(torch.int32).contiguous(), row_len.to(torch.int32).contiguous()


def native_paged_attention(q: torch.Tensor, keys: list[torch.Tensor], k_weights: list, values: list[torch.Tensor],
                           v_weights: list, rows, block_table: torch.Tensor, scale: float, layout: int,
                           out: torch.Tensor, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """`cpu_paged_attention.c` over vLLM's CPU caches in place: q [T, H_q, D], caches [num_blocks, H_kv, bs, D]
    (the backend's split views) with their blocks in `layout` (`kernel_layout`'s name), `rows` from
    `query_rows`; writes and returns `out` [T, H_q, D]. `window` W: each row sees only its last W keys (p - W < k
    <= p); `softcap` c: scores -> c tanh(scores / c) after the scale (None or 0: neither). For layers
    the engine's selection gave this kernel (`native.paged_supports`, a readable block layout); arguments it
    cannot read are a ValueError (the kernel reads raw pointers), never a quiet fallback."""
    kind = native.PAGED_KINDS.get(keys[0].dtype)
    sources = [*keys, *values]
    if (kind is None or layout not in native.PAGED_LAYOUTS
            or len(keys) > native.PAGED_MAX_SOURCES or len(values) > native.PAGED_MAX_SOURCES
            or any(c.dtype != keys[0].dtype or c.stride() != keys[0].stride() for c in sources)
            or keys[0].stride(3) != 1 or keys[0].stride(2) != keys[0].shape[3]
            or block_table.dtype != torch.int32 or block_table.stride(1) != 1):
        raise ValueError("native paged attention: caches of one dtype it reads (float32, bfloat16) and one "
                         "layout it reads, 1-2 sources per side, an int32 block table with unit stride")
    t, h_q, d = q.shape
    h_kv, bs = keys[0].shape[1], keys[0].shape[2]

    def weights(ws):
        ws = [None if w is None else w.to(torch.float32).contiguous() for w in ws]
        ptrs = [None if w is None else w.data_ptr() for w in ws] + [None]
        return ws, ptrs[0], ptrs[1] if len(ws) > 1 else None

    kw, ka0, ka1 = weights(k_weights)
    vw, vb0, vb1 = weights(v_weights)
    if any(w is not None and w.numel() != h_kv * d for w in kw + vw):
        raise ValueError("native paged attention takes per-channel fusion weights [H_kv, D]")
    qf = q.to(torch.float32).contiguous()
    of = out if out.dtype == torch.float32 and out.is_contiguous() else torch.empty(t, h_q, d)
    row_seq, row_len = rows
    status = native.library().paged_attention(
        qf.data_ptr(), t, h_q, h_kv, d, scale, int(window or 0), float(softcap or 0.0), kind, row_seq.data_ptr(),
        row_len.data_ptr(), block_table.data_ptr(), block_table.stride(0), bs, keys[0].stride(0), keys[0].stride(1),
        layout,
        len(keys), keys[0].data_ptr(), keys[-1].data_ptr(), ka0, ka1, d,
        len(values), values[0].data_ptr(), values[-1].data_ptr(), vb0, vb1, d,
        of.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"native paged attention failed (status {status}: "
                           f"{'bad argument' if status == 1 else 'out of memory'})")
    if of is not out:
        out.copy_(of)
    return out


# ---- GPU backends: caches [num_blocks, block_size, H_kv, D] --------------------------------------------
def paged_cross_layer_attention(q: torch.Tensor, key_caches: list[torch.Tensor], k_weights: list,
                                value_caches: list[torch.Tensor], v_weights: list, query_start_loc: torch.Tensor,
                                seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float, *,
                                out: torch.Tensor | None = None, max_query_len: int | None = None,
                                max_seq_len: int | None = None, window: int | None = None,
                                softcap: float | None = None, use_kernel: bool) -> torch.Tensor:
    """Attention of one vLLM batch over fused paged sources (paper Sec. 3.3), nothing fused written.

    q: [T, H_q, D], the batch's query tokens, request r owning rows query_start_loc[r] : query_start_loc[r+1];
    its keys are the first seq_lens[r] tokens of its blocks (block_table[r]) in every cache
    ([num_blocks, block_size, H_kv, D]); weights per source [H_kv, D] or None. Decode rows (one query token)
    run batched, in the paged Triton kernel when `use_kernel` (the engine's choice for the layer:
    `select_paged_attention`), else gathered into `factored_attention`; longer rows (prefill, chunked
    prefill) are gathered per request and run with the causal mask. `window` W (None: none): a query at
    position p sees keys p - W < k <= p, and keys left of every row's window are not read; `softcap` c (None
    or 0: none): scores -> c tanh(scores / c) after the scale (Gemma 2), on the fused scores. A batch of
    decode rows only (`max_query_len` 1) is one kernel launch that reads no device value (CUDA-graph safe);
    mixed batches read the row lengths on the host.
    Returns `out` (a new [T, H_q, D] tensor in q's dtype if None); rows of no request are left untouched."""
    ks, kw = merge_duplicate_sources(list(key_caches), list(k_weights))
    vs, vw = merge_duplicate_sources(list(value_caches), list(v_weights))
    kw = [None if w is None else w.contiguous() for w in kw]
    vw = [None if w is None else w.contiguous() for w in vw]
    block_size = ks[0].shape[1]
    num_reqs = query_start_loc.shape[0] - 1
    window, softcap = window or None, softcap or None
    if out is None:
        out = torch.empty_like(q)
    if use_kernel:
        from ..kernels.triton_paged_decode import paged_decode_step  # lazy: imports triton

    if use_kernel and max_query_len == 1 and num_reqs <= q.shape[0]:
        # Decode only: request r's token is row r (requests past the real ones have seq_len 0 -> zeros).
        paged_decode_step(q[:num_reqs], ks, kw, vs, vw, block_table, seq_lens, scale, out=out[:num_reqs],
                          max_seq_len=max_seq_len, window=window, softcap=softcap)
        return out

    starts = query_start_loc.tolist()
    lens = seq_lens[:num_reqs].tolist()
    decodes = [r for r in range(num_reqs) if starts[r + 1] - starts[r] == 1]
    if decodes:
        rows = torch.tensor(decodes, device=q.device)
        tokens = torch.tensor([starts[r] for r in decodes], device=q.device)
        if use_kernel:
            out[tokens] = paged_decode_step(q[tokens], ks, kw, vs, vw, block_table[rows], seq_lens[rows], scale,
                                            max_seq_len=max(lens[r] for r in decodes), window=window,
                                            softcap=softcap)
        else:  # padded to the longest sequence, the tail (and what lies left of a window) masked
            n_blocks = -(-max(lens[r] for r in decodes) // block_size)
            # Table entries past a shorter sequence's end are not its blocks: any valid index will do.
            blocks = block_table[rows, :n_blocks].clamp(0, ks[0].shape[0] - 1)
            key_pos = torch.arange(n_blocks * block_size, device=q.device)[None, :]
            mask = key_pos < seq_lens[rows, None]
            if window:  # the query at position s - 1 sees keys s - W .. s - 1
                mask &= key_pos >= seq_lens[rows, None] - window
            # Zero the masked values too: a weight of 0 times whatever the slot holds must stay 0.
            v_src = [widened(gather_paged(c, blocks), q.dtype).masked_fill_(~mask[:, None, :, None], 0) for c in vs]
            o = factored_attention(q[tokens].unsqueeze(2), [widened(gather_paged(c, blocks), q.dtype) for c in ks], kw,
                                   v_src, vw,
                                   mask=mask[:, None, None, :], scale=scale, softcap=softcap)
            out[tokens] = o[:, :, 0].to(out.dtype)
    for r in range(num_reqs):
        t = starts[r + 1] - starts[r]
        if t <= 1:
            continue
        s = lens[r]
        # Query i of this chunk sits at position s - t + i and sees keys 0 .. s - t + i, or with a window only
        # the last W of those: keys before the first query's window (from `first`) are not gathered.
        first = max(s - t - window + 1, 0) if window else 0
        blocks = block_table[r:r + 1, first // block_size: -(-s // block_size)]
        skip = first - first // block_size * block_size
        q_pos = torch.arange(s - t, s, device=q.device)[:, None]
        key_pos = torch.arange(first, s, device=q.device)[None, :]
        mask = key_pos <= q_pos
        if window:
            mask &= q_pos - key_pos < window
        qr = q[starts[r]:starts[r + 1]].transpose(0, 1).unsqueeze(0)  # [1, H, t, D]
        o = factored_attention(qr, [widened(gather_paged(c, blocks)[:, :, skip:skip + s - first], q.dtype) for c in ks],
                               kw, [widened(gather_paged(c, blocks)[:, :, skip:skip + s - first], q.dtype) for c in vs],
                               vw, mask=mask,
                               scale=scale, softcap=softcap)
        out[starts[r]:starts[r + 1]] = o[0].transpose(0, 1).to(out.dtype)
    return out


def layer_window(sliding_window, on_gpu: bool) -> int | None:
    """A backend impl's `sliding_window` as the window W of the model's convention (a query at position p sees
    keys p - W < k <= p), None for no window. vLLM's CPU backend holds W (-1: none); its FlashAttention and
    Triton backends hold FlashAttention's `window_size` pair (W - 1, 0), keys p - (W - 1) .. p ((-1, -1): none)."""
    if not on_gpu:
        return None if sliding_window in (None, -1) else int(sliding_window)
    left, right = tuple(sliding_window)
    if (left, right) == (-1, -1):
        return None
    if left < 0 or right != 0:
        raise NotImplementedError(f"sliding window {(left, right)}: FusedKV reconstruction layers take causal "
                                  "windows (W - 1, 0) only")
    return left + 1


class StorageAttention:
    """Stands in for a storage layer's backend `impl` (it attends and writes its cache exactly as that impl does)
    where FusedKV reconstruction layers read the layer's rows of the step: the key and value rows it was given
    for a step with a prefill chunk (post-RoPE, as written to the cache), kept with that step's metadata until
    the next step. A whole-sequence prefill chunk's source rows are exactly these (`CrossLayerAttention`).

    `copy`: keep copies, for a compiled model (its rows are graph intermediates whose buffers the compiled
    graph may reuse after this layer's op); eager rows stay alive by reference."""

    def __init__(self, base_impl, copy: bool):
        self.base, self.copy = base_impl, copy
        self.rows: tuple | None = None  # (metadata, key [T, H_kv, D], value [T, H_kv, D])

    def __getattr__(self, name):  # backend attributes and methods (do_kv_cache_update, scale, ...)
        return getattr(self.base, name)

    def step_rows(self, meta) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(key, value) rows of the step whose metadata is `meta`, None if this layer did not keep that step's."""
        return self.rows[1:] if self.rows is not None and self.rows[0] is meta else None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        self.rows = None
        if attn_metadata is not None and attn_metadata.max_query_len >= PREFILL_ROWS:  # decode steps keep nothing
            t = attn_metadata.num_actual_tokens
            k, v = key[:t], value[:t]
            self.rows = (attn_metadata, k.clone() if self.copy else k, v.clone() if self.copy else v)
        return self.base.forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                 output_block_scale)


class CrossLayerAttention:
    """Stands in for a reconstruction layer's backend `impl` (see the module docstring).

    `k_layers` / `v_layers`: attention-layer names of the sources; `weights()` returns the current
    per-source fusion weights ([H_kv, D] tensors or None), K then V lists. How it attends is given once,
    by `use` (from `select_paths`, at weight loading); before that it refuses to run."""

    def __init__(self, base_impl, k_layers: list[str], v_layers: list[str], weights):
        # The backend is recognised by class name: each backend module imports only on its own platform build.
        names = {c.__name__ for c in type(base_impl).__mro__}
        self.on_gpu = bool(names & set(GPU_PAGED_IMPLS))
        if "CPUAttentionBackendImpl" not in names and not self.on_gpu:
            raise NotImplementedError(
                f"FusedKV reconstruction layers that read two different layers (Lite, FusedKV, custom source "
                f"maps) run on vLLM's CPU, FlashAttention and Triton attention backends, not on "
                f"{type(base_impl).__name__}; plans whose upper layers reuse one layer's K and V (vanilla, GQA, "
                "CLA, YOCO) run on any backend")
        self.fp8 = FP8_FORMATS.get(base_impl.kv_cache_dtype)  # an 8-bit cache's code format, else None
        if base_impl.kv_cache_dtype not in ("auto", "float32", "bfloat16", "float16") and self.fp8 is None:
            raise NotImplementedError(
                f"kv_cache_dtype={base_impl.kv_cache_dtype!r}: FusedKV reconstruction layers read unquantised caches "
                f"and vLLM's fp8 caches ({', '.join(FP8_FORMATS)})")
        if self.on_gpu and (base_impl.alibi_slopes is not None or getattr(base_impl, "sinks", None) is not None):
            raise NotImplementedError("FusedKV reconstruction layers on GPU take causal attention with an optional "
                                      "sliding window and soft cap (no ALiBi or sinks)")
        # The layer's window W (None: none) and soft cap c (None: none), as the model has them (a query at p
        # sees keys p - W < k <= p); the backends hold the window in their own forms (`layer_window`).
        self.window = layer_window(base_impl.sliding_window, self.on_gpu)
        self.softcap = base_impl.logits_soft_cap or None
        self.base = base_impl
        self.k_layers, self.v_layers = list(k_layers), list(v_layers)
        self.weights = weights
        self.path: str | None = None  # one of fusedkv.engine.selection.PAGED_PATHS, once selected
        self.layout: tuple = (None, None)  # the CPU backend's key / value block layouts (`paged_blocks.block_layout`)
        self.kernel_layout: int | None = None  # the native kernel's name for them (`kernel_layout`)
        self.step_rows = False  # its sources keep their rows of a step (`StorageAttention`), read by prefill
        self._attend = self._unselected

    def __getattr__(self, name):  # backend attributes the runner reads (sliding_window, scale, ...)
        return getattr(self.base, name)

    def process_weights_after_loading(self, act_dtype):
        self.base.process_weights_after_loading(act_dtype)

    def use(self, path: str, layout: tuple = (None, None), step_rows: bool = False) -> None:
        """Attend by `path` from now on (the engine's choice); `layout`: the CPU cache's block layouts; `step_rows`:
        every source layer is a `StorageAttention` (the native path's prefill chunks then read its rows)."""
        self.path, self.layout, self.kernel_layout = path, layout, kernel_layout(layout)
        self.step_rows = step_rows
        if self.on_gpu:  # both GPU paths share the batch handling: decode rows in the kernel or gathered
            self._attend = functools.partial(self._on_gpu, use_kernel=path == "triton")
        else:
            self._attend = {"vllm_op": self._with_cpu_op, "native": self._native, "gathered": self._gathered}[path]

    def _unselected(self, *args):
        raise RuntimeError("this FusedKV reconstruction layer has no attention path: serving's weight loading "
                           "selects one (fusedkv.serving.paged.select_paths)")

    # ---- the impl interface ---------------------------------------------------------------------
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantisation is not supported by FusedKV layers")
        if attn_metadata is None:  # profiling / warm-up run: no cache yet
            return output
        from vllm.forward_context import get_forward_context

        t = attn_metadata.num_actual_tokens
        self._attend(layer, get_forward_context().no_compile_layers, query[:t], attn_metadata, output[:t])
        return output

    def _sources(self, layers, split):
        """The sources' key and value caches (split as the backend splits them) and the fusion weights; an 8-bit
        cache's codes viewed in their fp8 format, each source layer's scale folded into its weight."""
        keys = [split(layers[n].kv_cache)[0] for n in self.k_layers]
        values = [split(layers[n].kv_cache)[1] for n in self.v_layers]
        k_weights, v_weights = self.weights()
        if self.fp8 is None:
            return keys, values, k_weights, v_weights
        h_kv, d, device = self.base.num_kv_heads, self.base.head_size, keys[0].device
        k_weights = with_scales(k_weights, [layers[n]._k_scale_float for n in self.k_layers], h_kv, d, device)
        v_weights = with_scales(v_weights, [layers[n]._v_scale_float for n in self.v_layers], h_kv, d, device)
        return [c.view(self.fp8) for c in keys], [c.view(self.fp8) for c in values], k_weights, v_weights

    def _cpu_sources(self, layers):
        return self._sources(layers, split_cpu_kv_cache)

    # ---- GPU backends: the paged kernel for decode rows, gathered prefill --------------------------
    def _on_gpu(self, layer, layers, q, meta, out, use_kernel: bool):
        if not self._one_block_table:
            self._check_one_block_table(meta)
        # A layer listed twice gives views of the same memory, which the kernel merges.
        keys, values, k_weights, v_weights = self._sources(
            layers, functools.partial(split_gpu_kv_cache, head_dim=self.base.head_size))
        # Under CUDA-graph capture the split sizes must not depend on this step's lengths (replays get
        # longer sequences): the kernel then sizes them from the block table's width.
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
        paged_cross_layer_attention(
            q, keys, k_weights, values, v_weights, meta.query_start_loc, meta.seq_lens, meta.block_table,
            self.base.scale, out=out, max_query_len=meta.max_query_len,
            max_seq_len=None if capturing else meta.max_seq_len, window=self.window, softcap=self.softcap,
            use_kernel=use_kernel)

    # ---- one K source: vLLM's op, once per V source ---------------------------------------------
    def _with_cpu_op(self, layer, layers, q, meta, out):
        from vllm import _custom_ops as ops

        # The raw caches (an 8-bit cache's codes, which the op dequantises with the source layers' scales).
        keys = [split_cpu_kv_cache(layers[n].kv_cache)[0] for n in self.k_layers]
        values = [split_cpu_kv_cache(layers[n].kv_cache)[1] for n in self.v_layers]
        k_weights, v_weights = self.weights()
        key_cache, k_weight = keys[0], k_weights[0]
        k_scale = layers[self.k_layers[0]]._k_scale_float
        h_kv = key_cache.shape[1]
        if k_weight is not None:  # key fusion on the query: (a (.) q) . k
            t, h, d = q.shape
            q = (q.view(t, h_kv, h // h_kv, d) * k_weight[None, :, None, :].to(q.dtype)).view(t, h, d)
        for i, (value_cache, w, v_layer) in enumerate(zip(values, v_weights, self.v_layers)):
            target = out if i == 0 and w is None else torch.empty_like(out)
            ops.cpu_attention_with_kv_cache(
                query=q.contiguous(), key_cache=key_cache, value_cache=value_cache, output=target,
                query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens, scale=self.base.scale,
                causal=meta.causal, alibi_slopes=self.base.alibi_slopes, sliding_window=self.base.sliding_window,
                block_table=meta.block_table, softcap=self.base.logits_soft_cap,
                scheduler_metadata=meta.scheduler_metadata, s_aux=self.base.sinks,
                dynamic_causal=meta.dynamic_causal, k_scale=k_scale, v_scale=layers[v_layer]._v_scale_float,
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

    # ---- several K sources: the native kernel over the blocks in place -----------------------------
    _one_block_table = False  # GPU: the sources were seen to share this layer's block table (once is enough)

    def _check_one_block_table(self, meta) -> None:
        """The kernel and the gather read every source through this layer's block table (its KV-cache group's, its
        first K source's). On GPU, vLLM's hybrid KV-cache manager can give a sliding-window hybrid's layers of one
        type several groups, each with its own block table: a source in another group would be read at the wrong
        blocks, so that is refused, once, at the first step with metadata (the groups are fixed by then)."""
        from vllm.forward_context import get_forward_context

        per_layer = get_forward_context().attn_metadata
        if not isinstance(per_layer, dict):  # micro-batched steps list one dict per micro-batch: checked elsewhere
            return
        ptr = meta.block_table.data_ptr()
        others = [n for n in dict.fromkeys(self.k_layers + self.v_layers)
                  if getattr(per_layer.get(n), "block_table", None) is not None
                  and per_layer[n].block_table.data_ptr() != ptr]
        if others:
            raise NotImplementedError(
                f"a FusedKV reconstruction layer reads {others} from other KV-cache groups than its own (vLLM's hybrid "
                "KV-cache manager gave them separate block tables); serve with --disable-hybrid-kv-cache-manager")
        self._one_block_table = True

    _step_rows: tuple = (None, None)  # (a step's metadata, its `query_rows`): shared by every layer of the step

    def _native(self, layer, layers, q, meta, out):
        keys, values, k_weights, v_weights = self._cpu_sources(layers)
        if meta.max_query_len < PREFILL_ROWS:  # decode steps: every row in the kernel
            native_paged_attention(q, keys, k_weights, values, v_weights, self._rows(meta, q.shape[0]),
                                   meta.block_table, self.base.scale, self.kernel_layout, out, self.window,
                                   self.softcap)
            return
        # Long prefill chunks over their fused K/V with SDPA (the kernel works row by row, and a chunk of t rows
        # re-reads the sequence t times); the other rows in the kernel.
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens[:len(starts) - 1].tolist()
        long = [r for r in range(len(starts) - 1) if starts[r + 1] - starts[r] >= PREFILL_ROWS]
        self._prefill_chunks(layers, q, meta, out, keys, k_weights, values, v_weights, long, starts, seq_lens)
        in_kernel = torch.ones(q.shape[0], dtype=torch.bool)
        for r in long:
            in_kernel[starts[r]:starts[r + 1]] = False
        tokens = in_kernel.nonzero()[:, 0]
        if tokens.numel():
            row_seq, row_len = self._rows(meta, q.shape[0])
            o = native_paged_attention(q[tokens], keys, k_weights, values, v_weights,
                                       (row_seq[tokens].contiguous(), row_len[tokens].contiguous()), meta.block_table,
                                       self.base.scale, self.kernel_layout, torch.empty_like(q[tokens]), self.window,
                                       self.softcap)
            out[tokens] = o.to(out.dtype)

    def _prefill_chunks(self, layers, q, meta, out, keys, k_weights, values, v_weights, requests, starts, seq_lens):
        """Each listed request's prefill chunk in `fused_chunk_attention`: a chunk that is its whole sequence over
        the storage layers' rows of this step (`StorageAttention.rows`), a chunk that starts mid-sequence over its
        gathered blocks."""
        # The source layers' rows of this step, where they kept this step's (fast prefill gives the upper layers
        # metadata of their own: then every chunk gathers).
        kept = [layers[n].impl.step_rows(meta) for n in self.k_layers + self.v_layers] if self.step_rows else [None]
        step = None
        if all(rows is not None for rows in kept):
            step = [rows[0] for rows in kept[:len(keys)]], [rows[1] for rows in kept[len(keys):]]
        block_size = keys[0].shape[2]
        key_layout, value_layout = self.layout
        for r in requests:
            a, b, s = starts[r], starts[r + 1], seq_lens[r]
            if step is not None and s == b - a:  # starts at 0: its sources are the storage layers' rows of this step
                k_src, v_src = [x[a:b] for x in step[0]], [x[a:b] for x in step[1]]
            else:
                blocks = meta.block_table[r:r + 1, : -(-s // block_size)]
                k_src = [gather_blocks(c, blocks, key_layout)[0, :, :s].transpose(0, 1) for c in keys]
                v_src = [gather_blocks(c, blocks, value_layout)[0, :, :s].transpose(0, 1) for c in values]
            # Rounded as the cache stores them, so that a chunk reads what a later step would read back.
            k_src = [x.to(keys[0].dtype) for x in k_src]
            v_src = [x.to(values[0].dtype) for x in v_src]
            out[a:b] = fused_chunk_attention(q[a:b], k_src, k_weights, v_src, v_weights, self.base.scale, self.window,
                                             self.softcap).to(out.dtype)

    @staticmethod
    def _rows(meta, num_tokens: int):
        """The batch's query rows, computed once per step: the runner builds a new metadata object every step,
        and the one held here cannot be another step's."""
        held, rows = CrossLayerAttention._step_rows
        if held is not meta:
            rows = query_rows(meta.query_start_loc, meta.seq_lens, num_tokens)
            CrossLayerAttention._step_rows = (meta, rows)
        return rows

    # ---- fallback: gather each sequence's blocks, factored attention -----------------------------
    def _gathered(self, layer, layers, q, meta, out):
        keys, values, k_weights, v_weights = self._cpu_sources(layers)
        block_size = keys[0].shape[2]
        key_layout, value_layout = self.layout
        starts = meta.query_start_loc.tolist()
        num_reqs = len(starts) - 1
        seq_lens = meta.seq_lens[:num_reqs].tolist()
        decodes = [r for r in range(num_reqs) if starts[r + 1] - starts[r] == 1]
        window = self.window  # W, or None (`layer_window`)
        if decodes:
            # One-token steps, batched: pad to the longest sequence and mask the tail.
            rows = torch.tensor(decodes)
            lens = meta.seq_lens[rows]
            n_blocks = -(-max(seq_lens[r] for r in decodes) // block_size)
            blocks = meta.block_table[rows, :n_blocks]
            k_src = [widened(gather_blocks(c, blocks, key_layout), q.dtype) for c in keys]
            v_src = [widened(gather_blocks(c, blocks, value_layout), q.dtype) for c in values]
            key_pos = torch.arange(n_blocks * block_size)[None, :]
            mask = key_pos < lens[:, None]  # [R, S]
            # Slots past a sequence's end hold whatever a freed block held (a non-finite value included): a
            # masked key's probability is 0, but 0 x NaN in P V is NaN, so those rows of the gathered copies
            # (never the cache itself) are zeroed.
            for v in v_src:
                v.masked_fill_(~mask[:, None, :, None], 0)
            if window:  # a window layer's query at position s - 1 sees keys s - W .. s - 1
                mask &= key_pos >= lens[:, None] - window
            token_rows = torch.tensor([starts[r] for r in decodes])
            o = factored_attention(q[token_rows].unsqueeze(2), k_src, k_weights, v_src, v_weights,  # [R, H, 1, D]
                                   mask=mask[:, None, None, :], scale=self.base.scale,
                                   softcap=self.softcap)
            out[token_rows] = o[:, :, 0].to(out.dtype)
        chunks = [r for r in range(num_reqs) if starts[r + 1] - starts[r] > 1]
        self._gathered_chunks(q, meta, out, keys, k_weights, values, v_weights, chunks, starts, seq_lens)

    def _gathered_chunks(self, q, meta, out, keys, k_weights, values, v_weights, requests, starts, seq_lens):
        """Each listed request's query rows (a prefill chunk) over its gathered blocks, causal (and windowed)."""
        block_size = keys[0].shape[2]
        key_layout, value_layout = self.layout
        window = self.window
        for r in requests:
            t = starts[r + 1] - starts[r]
            s = seq_lens[r]
            blocks = meta.block_table[r:r + 1, : -(-s // block_size)]
            k_src = [widened(gather_blocks(c, blocks, key_layout)[:, :, :s], q.dtype) for c in keys]
            v_src = [widened(gather_blocks(c, blocks, value_layout)[:, :, :s], q.dtype) for c in values]
            # Query i of this chunk sits at position s - t + i and sees keys 0 .. s - t + i.
            q_pos, key_pos = torch.arange(s - t, s)[:, None], torch.arange(s)[None, :]
            mask = key_pos <= q_pos
            if window:
                mask &= q_pos - key_pos < window
            qr = q[starts[r]:starts[r + 1]].transpose(0, 1).unsqueeze(0)  # [1, H, t, D]
            o = factored_attention(qr, k_src, k_weights, v_src, v_weights, mask=mask, scale=self.base.scale,
                                   softcap=self.softcap)
            out[starts[r]:starts[r + 1]] = o[0].transpose(0, 1).to(out.dtype)


def select_paths(layers: list[CrossLayerAttention], model_dtype: torch.dtype, device: torch.device,
                 block_size: int, storage: dict | None = None, compiled: bool = False) -> None:
    """Give each reconstruction layer its attention path, once, from the engine's selection (serving's
    weight loading calls this: the model's dtype, device and the cache's block size are known then).

    `storage`: the storage layers' vLLM `Attention` modules by layer name. The source layers of a layer on the
    native path get a `StorageAttention` impl (copying its rows where the model is `compiled`), so that its
    whole-sequence prefill chunks read this step's rows instead of the cache."""
    from ..engine.selection import select_paged_attention

    storage = storage or {}
    for impl in layers:
        dtype = cache_element_dtype(impl.kv_cache_dtype, model_dtype)
        layout = (None, None)
        if not impl.on_gpu and len(impl.k_layers) > 1:
            layout = cpu_cache_layout(model_dtype, dtype, impl.kv_cache_dtype, block_size, impl.head_size)
        path = select_paged_attention(impl.k_layers, impl.v_layers, gpu=impl.on_gpu, head_dim=impl.head_size,
                                      device=device, dtype=dtype, query_dtype=model_dtype,
                                      native_layout=kernel_layout(layout))
        sources = impl.k_layers + impl.v_layers
        # An 8-bit cache's chunks read the codes back (the rows of the step are not yet rounded to them).
        step_rows = path == "native" and impl.fp8 is None and all(n in storage for n in sources)
        if step_rows:
            for n in sources:
                if not isinstance(storage[n].impl, StorageAttention):
                    storage[n].impl = StorageAttention(storage[n].impl, copy=compiled)
        impl.use(path, layout, step_rows)
