"""The GPU path of FusedKV reconstruction layers served by vLLM: the paged Triton kernel over the source layers'
caches in place (vLLM's FlashAttention or Triton backend: caches [num_blocks, block_size, H_kv, D]).

Decode rows (one query token) run in one launch of `fusedkv.kernels.triton_paged_decode` (paper Sec. 3.3, the
factored form over the blocks in place, through the block table); prefill chunks are gathered per request into
the model's reference attention (`paged_gathered.attend_chunks`). A batch of decode rows only is one launch that
reads no device value (CUDA-graph safe); mixed batches read the row lengths on the host. The engine's selection
gives a layer this path where the kernel runs on the device and dtype and takes the distinct sources; elsewhere a
GPU layer takes the gathered path (`paged_gathered.GatheredPath`).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ..model.attention import ReferenceAttention
from ..model.fusion import KVSources
from .paged_gathered import BlockReader, GatheredPath, attend_chunks, split_batch


def triton_attention(q: torch.Tensor, sources: KVSources, meta, attention, window: int | None, out: torch.Tensor,
                     max_seq_len: int | None) -> None:
    """One vLLM batch (`meta`: query_start_loc, seq_lens, block_table, max_query_len) over distinct paged sources:
    decode rows in the kernel, prefill chunks gathered. `max_seq_len`: the batch's longest sequence, or None to size
    the kernel's splits from the block table's width (under CUDA-graph capture)."""
    from ..kernels.triton_paged_decode import paged_decode_step  # lazy: imports triton

    keys, values = list(sources.keys), list(sources.values)
    kw = [None if w is None else w.contiguous() for w in sources.key_weights]
    vw = [None if w is None else w.contiguous() for w in sources.value_weights]
    scale, softcap = attention.scale, attention.softcap or None
    num_reqs = meta.query_start_loc.shape[0] - 1
    if meta.max_query_len == 1 and num_reqs <= q.shape[0]:
        # Decode only: request r's token is row r (requests past the real ones have seq_len 0 -> zeros).
        paged_decode_step(q[:num_reqs], keys, kw, values, vw, meta.block_table, meta.seq_lens, scale,
                          out=out[:num_reqs], max_seq_len=max_seq_len, window=window, softcap=softcap)
        return
    starts, lens, decodes, chunks = split_batch(meta.query_start_loc, meta.seq_lens)
    if decodes:
        rows = torch.tensor(decodes, device=q.device)
        tokens = torch.tensor([starts[r] for r in decodes], device=q.device)
        out[tokens] = paged_decode_step(q[tokens], keys, kw, values, vw, meta.block_table[rows], meta.seq_lens[rows],
                                        scale, max_seq_len=max(lens[r] for r in decodes), window=window,
                                        softcap=softcap)
    attend_chunks(q, sources, BlockReader.gpu(), chunks, starts, lens, meta.block_table, attention, window, out)


class TritonPath:
    """A GPU layer's rows with decode rows in the paged Triton kernel: `path(q, sources, meta, out, layers)`.
    `graphs`: the model runs on a CUDA device, where vLLM may capture steps as CUDA graphs (not under Triton's
    interpreter on CPU tensors)."""

    def __init__(self, attention, window: int | None, graphs: bool):
        self.attention, self.window, self.graphs = attention, window, graphs

    def __call__(self, q: torch.Tensor, sources: KVSources, meta, out: torch.Tensor, layers=None) -> None:
        # Under CUDA-graph capture the split sizes must not depend on this step's lengths (replays get longer
        # sequences): the kernel then sizes them from the block table's width.
        capturing = self.graphs and torch.cuda.is_current_stream_capturing()
        triton_attention(q, sources, meta, self.attention, self.window, out,
                         None if capturing else meta.max_seq_len)


def paged_cross_layer_attention(q: torch.Tensor, key_caches: list[torch.Tensor], k_weights: list,
                                value_caches: list[torch.Tensor], v_weights: list, query_start_loc: torch.Tensor,
                                seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float, *,
                                out: torch.Tensor | None = None, max_query_len: int | None = None,
                                max_seq_len: int | None = None, window: int | None = None,
                                softcap: float | None = None, use_kernel: bool) -> torch.Tensor:
    """Attention of one vLLM batch over fused paged GPU-layout sources (paper Sec. 3.3), as a served layer on
    the Triton path (`use_kernel`) or the gathered one runs it; for checks of the kernel outside vLLM.

    q: [T, H_q, D], the batch's query tokens, request r owning rows query_start_loc[r] : query_start_loc[r+1];
    its keys are the first seq_lens[r] tokens of its blocks (block_table[r]) in every cache
    ([num_blocks, block_size, H_kv, D], distinct tensors); weights per source [H_kv, D] or None. `window` W (None:
    none): a query at position p sees keys p - W < k <= p; `softcap` c (None or 0: none): scores -> c tanh(scores
    / c) after the scale (Gemma 2). Returns `out` (a new [T, H_q, D] tensor in q's dtype if None); rows of no
    request are left untouched."""
    sources = KVSources(tuple(key_caches), tuple(k_weights), tuple(value_caches), tuple(v_weights))
    attention = ReferenceAttention(scale, q.shape[1] != key_caches[0].shape[2], softcap or None)
    meta = SimpleNamespace(query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
                           max_query_len=max_query_len, max_seq_len=max_seq_len)
    out = torch.empty_like(q) if out is None else out
    if use_kernel:
        triton_attention(q, sources, meta, attention, window or None, out, max_seq_len)
    else:
        GatheredPath(BlockReader.gpu(), attention, window or None)(q, sources, meta, out)
    return out
