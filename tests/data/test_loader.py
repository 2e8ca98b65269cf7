"""TokenBatches (random, resumable, rank-split training batches) and iter_eval_batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fusedkv.data import ShardWriter, TokenBatches, TokenShard, iter_eval_batches, num_eval_windows
from fusedkv.data.shards import targets_path_for
from fusedkv.model.loss import IGNORE_INDEX

N = 10_000


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> TokenShard:
    # Token value == position, so every window is easy to check.
    path = tmp_path_factory.mktemp("shard") / "train.bin"
    w = ShardWriter(path, vocab_size=65_000, eos_id=0)
    w.write(np.arange(N), documents=1)
    w.close()
    return TokenShard(path)


def take(it, n):
    return [next(it) for _ in range(n)]


def test_shapes_dtypes_and_shifted_labels(shard):
    x, y = next(TokenBatches(shard, seq_len=16, batch_size=4, seed=0))
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y, x + 1)  # labels are the next tokens of a seq_len+1 window
    assert int(x.min()) >= 0 and int(y.max()) < N


def test_deterministic_and_seed_dependent(shard):
    a = take(TokenBatches(shard, 16, 4, seed=7), 3)
    b = take(TokenBatches(str(shard.path), 16, 4, seed=7), 3)  # a path works too
    c = take(TokenBatches(shard, 16, 4, seed=8), 3)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a, b))
    assert not all(torch.equal(p[0], q[0]) for p, q in zip(a, c))
    assert not torch.equal(a[0][0], a[1][0])  # steps differ
    tb = TokenBatches(shard, 16, 4, seed=7)
    assert torch.equal(tb.batch_at(2)[0], a[2][0]) and tb.step == 0


def test_resume_from_state_dict(shard):
    full = TokenBatches(shard, 32, 3, seed=1)
    expected = take(full, 8)
    run = TokenBatches(shard, 32, 3, seed=1)
    take(run, 5)
    state = run.state_dict()
    assert state["step"] == 5
    resumed = TokenBatches(shard, 32, 3, seed=1)
    resumed.load_state_dict(state)
    for (x, y), (ex, ey) in zip(take(resumed, 3), expected[5:]):
        assert torch.equal(x, ex) and torch.equal(y, ey)
    with pytest.raises(ValueError, match="cannot resume.*seed"):
        TokenBatches(shard, 32, 3, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="global_batch_size"):
        TokenBatches(shard, 32, 4, seed=1).load_state_dict(state)


def test_rank_split_matches_single_process(shard):
    single = TokenBatches(shard, 16, batch_size=8, seed=3)
    ranks = [TokenBatches(shard, 16, batch_size=4, seed=3, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):
        x, y = next(single)
        parts = [next(r) for r in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)
    # The layout may change on resume as long as the global batch is the same.
    resumed = TokenBatches(shard, 16, batch_size=4, seed=3, rank=1, world_size=2)
    resumed.load_state_dict(single.state_dict())
    assert torch.equal(next(resumed)[0], next(single)[0][4:])
    with pytest.raises(ValueError, match="rank"):
        TokenBatches(shard, 16, 4, rank=2, world_size=2)


def test_short_shard_is_a_clear_error(tmp_path):
    w = ShardWriter(tmp_path / "tiny.bin", vocab_size=100, eos_id=0)
    w.write(np.arange(10), documents=1)
    w.close()
    tiny = TokenShard(tmp_path / "tiny.bin")
    with pytest.raises(ValueError, match=r"10 tokens, fewer than seq_len \+ 1 = 11"):
        TokenBatches(tiny, seq_len=10, batch_size=2)
    with pytest.raises(ValueError, match="fewer than seq_len"):
        next(iter_eval_batches(tiny, seq_len=16, batch_size=2))
    assert next(TokenBatches(tiny, seq_len=9, batch_size=2))[0].shape == (2, 9)


def test_eval_batches_cover_shard_sequentially(shard):
    L, B = 64, 5
    n_windows = num_eval_windows(shard, L)
    assert n_windows == (N - 1) // L
    batches = list(iter_eval_batches(shard, L, B))
    assert len(batches) == -(-n_windows // B)
    assert [x.shape[0] for x, _ in batches[:-1]] == [B] * (len(batches) - 1)
    assert batches[-1][0].shape[0] == (n_windows % B or B)
    xs = torch.cat([x for x, _ in batches]).flatten()
    ys = torch.cat([y for _, y in batches]).flatten()
    assert torch.equal(xs, torch.arange(n_windows * L))
    assert torch.equal(ys, torch.arange(1, n_windows * L + 1))
    again = list(iter_eval_batches(shard, L, B, max_batches=3))
    assert len(again) == 3 and all(torch.equal(a[0], b[0]) for a, b in zip(again, batches))
    split = [list(iter_eval_batches(shard, L, B, rank=r, world_size=2)) for r in range(2)]
    for r in range(2):
        assert len(split[r]) == len(batches[r::2])
        assert all(torch.equal(a[0], b[0]) for a, b in zip(split[r], batches[r::2]))


def test_loss_mask_turns_context_tokens_into_ignored_labels(tmp_path):
    path = tmp_path / "train.bin"
    w = ShardWriter(path, vocab_size=65_000, eos_id=0, targets=True)
    w.write(np.arange(100), documents=1)  # a document counted in full (no mask given)
    w.write(np.arange(100, 200), documents=1, targets=np.arange(100) % 3 == 0)  # every third token a target
    w.close()
    shard = TokenShard(path)
    keep = np.concatenate([np.ones(100, bool), np.arange(100) % 3 == 0])
    for x, y in [TokenBatches(shard, seq_len=16, batch_size=8, seed=1).batch_at(0),
                 *iter_eval_batches(shard, seq_len=16, batch_size=4)]:
        expect = torch.where(torch.from_numpy(keep[(x + 1).numpy()]), x + 1, IGNORE_INDEX)
        assert torch.equal(y, expect)  # labels are the next tokens, or IGNORE_INDEX where context only
    # A mask that does not match the tokens is refused when the shard is opened.
    targets_path_for(path).write_bytes(b"\x01" * 10)
    with pytest.raises(ValueError, match="loss mask"):
        TokenShard(path)
    with pytest.raises(ValueError, match="targets of shape"):
        ShardWriter(tmp_path / "other.bin", 100, 0, targets=True).write(np.arange(5), targets=np.ones(4))
