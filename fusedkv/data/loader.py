"""Batches for causal-LM training and evaluation, drawn from a flat token shard.

Training (:class:`TokenBatches`): an infinite, epoch-less stream of random windows. The design goal
is exact reproducibility under interruption and under any data-parallel layout:

* The *global* batch at step ``k`` is a pure function of ``(seed, k)``: its window starts come from a
  NumPy generator seeded with ``SeedSequence([seed, k])``. No generator state is carried from step to
  step, so resuming needs only the step counter (``state_dict() == {"step": k, ...}``) and skipping
  ahead is free.
* Rank ``r`` of ``world_size`` takes the contiguous rows ``[r*B, (r+1)*B)`` of the global batch of
  ``B*world_size`` rows. Hence one process with batch 8 sees exactly the rows of two processes with
  batch 4 (concatenated in rank order), and a run may even be resumed on a different number of GPUs
  as long as the global batch size is unchanged.

Each row is a window of ``seq_len + 1`` tokens; ``input_ids`` are its first ``seq_len`` tokens and
``labels`` the last ``seq_len`` (the next-token targets), both int64 as ``nn.CrossEntropyLoss``
and embedding lookups expect. Windows may cross document boundaries; the EOS token between
documents tells the model where one ends (standard GPT-style packing, no padding). A shard with a loss
mask (``TokenShard.targets``, written for synthetic documents trained on their answers) yields
``IGNORE_INDEX`` as the label of every token that is context only.

Evaluation (:func:`iter_eval_batches`): consecutive non-overlapping windows from the start of the
shard -- deterministic, every target token scored at most once, so the mean loss is a proper
held-out cross-entropy.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..model.loss import IGNORE_INDEX
from .shards import TokenShard

STATE_VERSION = 1


def _open(shard) -> tuple[np.ndarray, np.ndarray | None]:
    """(tokens, loss mask or None) of a TokenShard, a path to a .bin, or any 1-D integer array (handy in
    tests; no mask)."""
    if isinstance(shard, (str, Path)):
        shard = TokenShard(shard)
    if isinstance(shard, TokenShard):
        return shard.tokens, shard.targets
    arr = np.asarray(shard)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"expected a 1-D integer token array, got shape {arr.shape} dtype {arr.dtype}")
    return arr, None


def _check_length(tokens: np.ndarray, seq_len: int, what: str) -> None:
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if len(tokens) < seq_len + 1:
        raise ValueError(
            f"{what} has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1} needed for one "
            f"(input, label) window. Use a shorter seq_len or more data (a larger corpus or a larger "
            f"validation fraction)."
        )


def _gather(tokens: np.ndarray, starts: np.ndarray, seq_len: int,
            targets: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    # One fancy-indexing read of [B, seq_len+1] from the memmap; only those pages are touched.
    idx = starts[:, None].astype(np.int64) + np.arange(seq_len + 1, dtype=np.int64)
    windows = torch.from_numpy(np.array(tokens[idx], dtype=np.int64))  # plain ndarray, not memmap
    labels = windows[:, 1:].contiguous()
    if targets is not None:
        labels[torch.from_numpy(np.array(targets[idx[:, 1:]]) == 0)] = IGNORE_INDEX
    return windows[:, :-1].contiguous(), labels


class TokenBatches:
    """Infinite, deterministic, resumable ``(input_ids, labels)`` batches of shape [batch_size, seq_len].

    ``batch_size`` is per rank; the global batch is ``batch_size * world_size``. Iterate it (``next``)
    or call :meth:`batch_at` for any step directly. ``state_dict()`` / ``load_state_dict()`` save and
    restore the position (the number of batches already produced).
    """

    def __init__(self, shard, seq_len: int, batch_size: int, seed: int = 0, rank: int = 0,
                 world_size: int = 1):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.tokens, self.targets = _open(shard)
        _check_length(self.tokens, seq_len, f"token shard {getattr(shard, 'path', '')}".strip())
        self.seq_len, self.batch_size, self.seed = int(seq_len), int(batch_size), int(seed)
        self.rank, self.world_size = int(rank), int(world_size)
        self.global_batch_size = self.batch_size * self.world_size
        # Last valid start: a window of seq_len+1 tokens must fit.
        self.num_starts = len(self.tokens) - self.seq_len
        self.step = 0

    def global_starts(self, step: int) -> np.ndarray:
        """Window starts of the whole global batch at ``step`` (a pure function of seed and step)."""
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, int(step)]))
        return rng.integers(0, self.num_starts, size=self.global_batch_size, dtype=np.int64)

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(input_ids, labels)`` at ``step``, without changing the iterator position."""
        starts = self.global_starts(step)
        mine = starts[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        return _gather(self.tokens, mine, self.seq_len, self.targets)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def state_dict(self) -> dict:
        # Everything that determines the stream, so load_state_dict can refuse a mismatched resume.
        return {
            "version": STATE_VERSION,
            "step": self.step,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "num_tokens": len(self.tokens),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state["step"]``. The seed, seq_len, global batch size and shard length must
        match (the rank layout may change), otherwise the batches would silently differ."""
        for key in ("seed", "seq_len", "global_batch_size", "num_tokens"):
            mine = self.state_dict()[key]
            if key in state and state[key] != mine:
                raise ValueError(
                    f"cannot resume TokenBatches: saved {key}={state[key]} but this loader has {mine}; "
                    f"the resumed run would see different batches. Use the original settings/data."
                )
        self.step = int(state["step"])


def num_eval_windows(shard, seq_len: int) -> int:
    """How many non-overlapping (input, label) windows of ``seq_len`` fit in the shard."""
    return (len(_open(shard)[0]) - 1) // seq_len


def iter_eval_batches(shard, seq_len: int, batch_size: int, max_batches: int | None = None,
                      rank: int = 0, world_size: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Sequential, non-overlapping ``(input_ids, labels)`` windows from the start of the shard.

    Window ``i`` has inputs ``tokens[i*seq_len:(i+1)*seq_len]`` and labels shifted by one; together
    they score every token from 1 to ``n_windows*seq_len`` exactly once. The last batch may be
    smaller than ``batch_size``; the trailing partial window is dropped. ``max_batches`` caps the
    (global) number of batches for a quick estimate; with ``world_size > 1`` batch ``j`` goes to rank
    ``j % world_size`` so ranks split the work without overlap.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_batches is not None and max_batches < 0:
        raise ValueError(f"max_batches must be >= 0, got {max_batches}")
    tokens, targets = _open(shard)
    _check_length(tokens, seq_len, f"evaluation shard {getattr(shard, 'path', '')}".strip())
    n_windows = (len(tokens) - 1) // seq_len
    n_batches = -(-n_windows // batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    for j in range(rank, n_batches, world_size):
        first = j * batch_size
        starts = np.arange(first, min(first + batch_size, n_windows), dtype=np.int64) * seq_len
        yield _gather(tokens, starts, seq_len, targets)
