"""The gathered path of FusedKV reconstruction layers served by vLLM, and the one place that gathers paged blocks.

Each request's source blocks are copied into token order and attended with the model's own attention
(`fusedkv.model.attention.ReferenceAttention`: the fused K/V of paper Eq. 4-5, then SDPA, or Gemma 2's
soft-capped softmax), so a served chunk computes exactly what the transformers model computes. It serves

  * every row of a layer the engine's selection gave no kernel (`GatheredPath`: CPU with more than two sources,
    a block layout the native kernel does not read or no C compiler; GPU where the paged Triton kernel does not
    run): the batch's one-token (decode) rows together, padded to the longest sequence, and each prefill chunk;
  * the prefill chunks of the kernels' paths (`attend_chunks`): the native and Triton kernels work one query row
    at a time, and a chunk of t rows attends better as one block.

Correct and simple; it copies. How a backend's blocks are laid out and read is `paged_blocks`; a `BlockReader`
holds one layer's reading, decided once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..model.fusion import KVSources
from .paged_blocks import gather_blocks, gather_paged


@dataclass(frozen=True)
class BlockReader:
    """How one layer's source caches are read: `keys(cache, blocks)` / `values(cache, blocks)` take blocks [R, n]
    of a cache to [R, H_kv, n * block_size, D] in token order; `block_dim`: the cache's block-size dimension."""

    keys: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    values: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    block_dim: int

    @classmethod
    def cpu(cls, layout: tuple) -> BlockReader:
        """vLLM's CPU caches [num_blocks, H_kv, bs, D], keys and values in their (key, value) block layouts."""
        return cls(functools.partial(gather_blocks, layout=layout[0]),
                   functools.partial(gather_blocks, layout=layout[1]), 2)

    @classmethod
    def gpu(cls) -> BlockReader:
        """vLLM's FlashAttention / Triton caches [num_blocks, bs, H_kv, D]."""
        return cls(gather_paged, gather_paged, 1)

    def gather(self, sources: KVSources, blocks: torch.Tensor, dtype: torch.dtype) -> KVSources:
        """`sources` (over caches) read at blocks [R, n]: the same fusion over [R, H_kv, n * bs, D] copies, in
        `dtype` where a cache holds fp8 codes (their scales are in the weights, `KVSources.scaled`)."""
        return sources.on([widened(self.keys(c, blocks), dtype) for c in sources.keys],
                          [widened(self.values(c, blocks), dtype) for c in sources.values])


def widened(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A gathered copy of cache blocks in `dtype` where the cache holds fp8 codes."""
    return x.to(dtype) if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else x


def attend_decodes(q: torch.Tensor, sources: KVSources, reader: BlockReader, requests: list[int], tokens: list[int],
                   seq_lens: torch.Tensor, block_table: torch.Tensor, attention, window: int | None,
                   out: torch.Tensor) -> None:
    """One-token rows `tokens` of q [T, H_q, D] (request `requests[i]`'s query at position seq_len - 1), batched:
    each request's blocks gathered and padded to the longest, the tail (and what lies left of a window: keys
    p - W < k <= p) masked; `attention`: the layer's `ReferenceAttention`. Writes their rows of `out`."""
    rows = torch.tensor(requests, device=q.device)
    lens = seq_lens[rows].long()
    block_size = sources.keys[0].shape[reader.block_dim]
    n_blocks = -(-int(lens.max()) // block_size)
    # Table entries past a shorter sequence's end are not its blocks: any valid index will do (masked).
    blocks = block_table[rows, :n_blocks].clamp(0, sources.keys[0].shape[0] - 1)
    key_pos = torch.arange(n_blocks * block_size, device=q.device)[None, :]
    mask = key_pos < lens[:, None]  # [R, S]
    if window:
        mask &= key_pos >= lens[:, None] - window
    gathered = reader.gather(sources, blocks, q.dtype)
    # A masked key's probability is 0, but a slot outside the mask may hold anything a freed block held (a
    # non-finite value included) and 0 x NaN is NaN: those rows of the copies (never the cache) are zeroed.
    for x in (*gathered.keys, *gathered.values):
        x.masked_fill_(~mask[:, None, :, None], 0)
    index = torch.tensor(tokens, device=q.device)
    o = attention.attend(q[index].unsqueeze(2), gathered, mask[:, None, None, :], False)  # [R, H_q, 1, D]
    out[index] = o[:, :, 0].to(out.dtype)


def attend_chunk(q: torch.Tensor, sources: KVSources, seq_len: int, first: int, attention,
                 window: int | None) -> torch.Tensor:
    """One prefill chunk of t query rows q [t, H_q, D] at positions seq_len - t .. seq_len - 1 over its sources'
    rows `first` .. seq_len - 1 ([1, H_kv, seq_len - first, D]), causal (and windowed), in the layer's
    `ReferenceAttention`. A whole sequence with no window is SDPA's causal flag. Returns [t, H_q, D]."""
    t = q.shape[0]
    mask, causal = None, t == seq_len and first == 0 and not window
    if not causal:
        q_pos = torch.arange(seq_len - t, seq_len, device=q.device)[:, None]
        key_pos = torch.arange(first, seq_len, device=q.device)[None, :]
        mask = key_pos <= q_pos
        if window:
            mask &= q_pos - key_pos < window
    return attention.attend(q.transpose(0, 1)[None], sources, mask, causal)[0].transpose(0, 1)


def attend_chunks(q: torch.Tensor, sources: KVSources, reader: BlockReader, requests: list[int], starts: list[int],
                  seq_lens: list[int], block_table: torch.Tensor, attention, window: int | None, out: torch.Tensor,
                  step_rows: KVSources | None = None) -> None:
    """Each listed request's prefill chunk (rows starts[r] : starts[r + 1] of q) over its gathered blocks, from
    the first key its first query's window sees. `step_rows`: the sources' rows of this step ([T, H_kv, D] each,
    `paged_native.StorageAttention`); a chunk that is its whole sequence reads those instead of the cache,
    rounded as the cache stores them, so it reads what a later step would read back."""
    block_size = sources.keys[0].shape[reader.block_dim]
    for r in requests:
        a, b, s = starts[r], starts[r + 1], seq_lens[r]
        if step_rows is not None and s == b - a:
            rows = step_rows.on(_step_chunk(step_rows.keys, sources.keys, a, b),
                                _step_chunk(step_rows.values, sources.values, a, b))
            out[a:b] = attend_chunk(q[a:b], rows, s, 0, attention, window).to(out.dtype)
            continue
        # Keys left of the first query's window (before `first`) are not gathered.
        first = max(s - (b - a) - window + 1, 0) if window else 0
        blocks = block_table[r:r + 1, first // block_size: -(-s // block_size)]
        skip = first % block_size
        gathered = reader.gather(sources, blocks, q.dtype)
        gathered = gathered.on([x[:, :, skip:skip + s - first] for x in gathered.keys],
                               [x[:, :, skip:skip + s - first] for x in gathered.values])
        out[a:b] = attend_chunk(q[a:b], gathered, s, first, attention, window).to(out.dtype)


def _step_chunk(rows, caches, a: int, b: int) -> list[torch.Tensor]:
    """Rows a : b of a step's [T, H_kv, D] rows as [1, H_kv, b - a, D], rounded as the caches store them."""
    return [x[a:b].to(c.dtype).transpose(0, 1)[None] for x, c in zip(rows, caches)]


def split_batch(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> tuple[list[int], list[int], list[int],
                                                                              list[int]]:
    """(query row starts, sequence lengths, one-token requests, longer requests) of a vLLM batch, on the host."""
    starts = query_start_loc.tolist()
    num_reqs = len(starts) - 1
    lens = seq_lens[:num_reqs].tolist()
    decodes = [r for r in range(num_reqs) if starts[r + 1] - starts[r] == 1]
    chunks = [r for r in range(num_reqs) if starts[r + 1] - starts[r] > 1]
    return starts, lens, decodes, chunks


class GatheredPath:
    """Every row of a layer over gathered blocks: `path(q, sources, meta, out, layers)` for a vLLM batch."""

    def __init__(self, reader: BlockReader, attention, window: int | None):
        self.reader, self.attention, self.window = reader, attention, window

    def __call__(self, q: torch.Tensor, sources: KVSources, meta, out: torch.Tensor, layers=None) -> None:
        starts, lens, decodes, chunks = split_batch(meta.query_start_loc, meta.seq_lens)
        if decodes:
            attend_decodes(q, sources, self.reader, decodes, [starts[r] for r in decodes], meta.seq_lens,
                           meta.block_table, self.attention, self.window, out)
        attend_chunks(q, sources, self.reader, chunks, starts, lens, meta.block_table, self.attention, self.window,
                      out)
