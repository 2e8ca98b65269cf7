"""The CPU native path of FusedKV reconstruction layers served by vLLM: `cpu_paged_attention.c` over the source
layers' paged caches in place (paper Sec. 3.3, the factored form: nothing fused is written).

Two K sources (FusedKV, the iterative variant) need one softmax over the SUM of the sources' scores, which no call
of vLLM's op computes. The native kernel reads every source's blocks in place through the block table, decode rows
and short prefill chunks in one call (`native_paged_attention`, rows from `query_rows`). Prefill chunks of
`PREFILL_ROWS` or more rows attend as a normal layer's prefill does, in the model's reference attention over their
fused K/V (`paged_gathered.attend_chunks`: the kernel works one query row at a time and would re-read the sequence
for every row). A chunk that is its whole sequence (it starts at position 0: no chunked prefill, no prefix-cache
hit) takes its source rows from the storage layers' own inputs of this step, post-RoPE as they were written to
the cache (`StorageAttention`), so nothing is read back; a chunk that starts mid-sequence gathers its blocks.

The engine's selection gives a layer this path where the kernel is built and reads the cache's dtype and block
layout (`fusedkv.engine.selection.select_paged_attention`); the kernel refuses anything else with a ValueError.
"""

from __future__ import annotations

import torch

from ..kernels import native
from ..model.fusion import KVSources
from .paged_gathered import BlockReader, attend_chunks

# Prefill chunks of at least this many rows attend over their fused K/V (`attend_chunks`) instead of in the native
# kernel, which works one query row at a time and re-reads the sequence for every row; from about this many rows
# on, materialising is also faster than the factored form (the engine's threshold,
# `fusedkv.model.attention.SHORT_QUERY`). Figures: docs/serving.md, "FusedKV's prefill as a normal layer's".
PREFILL_ROWS = 16


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


class StorageAttention:
    """Stands in for a storage layer's backend `impl` (it attends and writes its cache exactly as that impl does)
    where FusedKV reconstruction layers read the layer's rows of the step: the key and value rows it was given
    for a step with a prefill chunk (post-RoPE, as written to the cache), kept with that step's metadata until
    the next step. A whole-sequence prefill chunk's source rows are exactly these (`NativePath`).

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


class NativePath:
    """A layer's rows in the native kernel, long prefill chunks over their fused K/V: `path(q, sources, meta,
    out, layers)`. `layout`: the CPU cache's (key, value) block layouts, `kernel_layout` the kernel's name for
    them; `step_rows`: the source layers are `StorageAttention`s (whole-sequence chunks read their rows)."""

    _step: tuple = (None, None)  # (a step's metadata, its `query_rows`): shared by every layer of the step

    def __init__(self, layer, layout: tuple, kernel_layout: int, step_rows: bool):
        self.layer, self.kernel_layout, self.step_rows = layer, kernel_layout, step_rows
        self.reader = BlockReader.cpu(layout)

    def __call__(self, q: torch.Tensor, sources: KVSources, meta, out: torch.Tensor, layers) -> None:
        layer = self.layer
        if meta.max_query_len < PREFILL_ROWS:  # decode steps: every row in the kernel
            self._kernel(q, sources, self._rows(meta, q.shape[0]), meta, out)
            return
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens[:len(starts) - 1].tolist()
        long = [r for r in range(len(starts) - 1) if starts[r + 1] - starts[r] >= PREFILL_ROWS]
        attend_chunks(q, sources, self.reader, long, starts, seq_lens, meta.block_table, layer.reference,
                      layer.window, out, self._kept_rows(sources, meta, layers))
        in_kernel = torch.ones(q.shape[0], dtype=torch.bool)
        for r in long:
            in_kernel[starts[r]:starts[r + 1]] = False
        tokens = in_kernel.nonzero()[:, 0]
        if tokens.numel():
            row_seq, row_len = self._rows(meta, q.shape[0])
            rows = (row_seq[tokens].contiguous(), row_len[tokens].contiguous())
            out[tokens] = self._kernel(q[tokens], sources, rows, meta, torch.empty_like(q[tokens])).to(out.dtype)

    def _kernel(self, q, sources: KVSources, rows, meta, out):
        return native_paged_attention(q, list(sources.keys), list(sources.key_weights), list(sources.values),
                                      list(sources.value_weights), rows, meta.block_table, self.layer.base.scale,
                                      self.kernel_layout, out, self.layer.window, self.layer.softcap)

    def _kept_rows(self, sources: KVSources, meta, layers) -> KVSources | None:
        """The source layers' rows of this step as the same fusion, where they kept this step's (fast prefill gives
        the upper layers metadata of their own: then every chunk gathers)."""
        if not self.step_rows:
            return None
        kept = [layers[n].impl.step_rows(meta) for n in (*self.layer.k_layers, *self.layer.v_layers)]
        if any(rows is None for rows in kept):
            return None
        n_k = len(sources.keys)
        return sources.on([rows[0] for rows in kept[:n_k]], [rows[1] for rows in kept[n_k:]])

    @staticmethod
    def _rows(meta, num_tokens: int):
        """The batch's query rows, computed once per step: the runner builds a new metadata object every step,
        and the one held here cannot be another step's."""
        held, rows = NativePath._step
        if held is not meta:
            rows = query_rows(meta.query_start_loc, meta.seq_lens, num_tokens)
            NativePath._step = (meta, rows)
        return rows
