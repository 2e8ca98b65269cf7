"""Sliding-window perplexity and validation loss checked against plain, independent loops."""

from __future__ import annotations

import math

import pytest
import torch

from fusedkv.eval.perplexity import (
    _windows,
    load_wikitext,
    sliding_window_perplexity,
    text_perplexity,
    validation_loss,
)


def _ids(tokenizer, text, n):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:n]
    assert len(ids) == n
    return torch.tensor(ids)


def test_single_window_matches_one_forward(model, tokenizer, corpus_text):
    ids = _ids(tokenizer, corpus_text, 60)
    with torch.no_grad():
        logits = model(ids[None]).logits[0]
    # every next-token log-prob from one forward pass over the whole sequence
    nll = -torch.log_softmax(logits.double(), -1)[:-1].gather(1, ids[1:, None]).squeeze(1)
    ref = math.exp(nll.mean().item())
    for stride in (8, 60, 200):
        out = sliding_window_perplexity(model, ids, max_length=64, stride=stride)
        assert out["num_tokens"] == 59
        assert out["ppl"] == pytest.approx(ref, rel=1e-5)
        assert out["nll_sum"] == pytest.approx(nll.sum().item(), rel=1e-5)


@pytest.mark.parametrize("max_length,stride,batch_size", [(16, 5, 1), (16, 5, 3), (12, 12, 2)])
def test_strided_scores_each_token_once(model, tokenizer, corpus_text, max_length, stride, batch_size):
    n = 53
    ids = _ids(tokenizer, corpus_text, n)
    out = sliding_window_perplexity(model, ids, max_length=max_length, stride=stride, batch_size=batch_size)
    assert out["num_tokens"] == n - 1

    # Hand loop, one window at a time: windows start every `stride` tokens (stride clamped to
    # max_length - 1 so that no window's first target lacks context); target t is scored by the first
    # window that contains it with at least one token of context.
    stride = min(stride, max_length - 1)
    scored = {}
    with torch.no_grad():
        for begin in range(0, n, stride):
            end = min(begin + max_length, n)
            logp = torch.log_softmax(model(ids[None, begin:end]).logits[0].double(), -1)
            for t in range(begin + 1, end):
                if t not in scored:
                    scored[t] = -logp[t - begin - 1, ids[t]].item()
            if end == n:
                break
    assert sorted(scored) == list(range(1, n))
    assert out["nll_sum"] == pytest.approx(sum(scored.values()), rel=1e-5)
    assert out["ppl"] == pytest.approx(math.exp(sum(scored.values()) / (n - 1)), rel=1e-5)


def test_windows_cover_every_target_once():
    for n, L, s in [(10, 4, 2), (100, 16, 15), (7, 32, 8), (33, 8, 1)]:
        targets = [t for _, end, first in _windows(n, L, s) for t in range(first, end)]
        assert targets == list(range(1, n))


def test_text_perplexity_runs(model, tokenizer, corpus_text):
    out = text_perplexity(model, tokenizer, corpus_text[:600], max_length=32, stride=16, batch_size=4)
    assert out["num_tokens"] > 0 and math.isfinite(out["ppl"]) and out["ppl"] > 1


def test_validation_loss_token_weighted(model, tokenizer, corpus_text):
    ids = _ids(tokenizer, corpus_text, 40)
    a = ids[:24].view(2, 12)
    b = ids[24:40].view(1, 16)
    b_labels = b.clone()
    b_labels[0, :5] = -100  # ignored positions
    loss = validation_loss(model, [(a, a.clone()), {"input_ids": b, "labels": b_labels}])

    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in [(a, a), (b, b_labels)]:
            logp = torch.log_softmax(model(x).logits.double(), -1)
            for r in range(x.size(0)):
                for t in range(1, x.size(1)):
                    if y[r, t] != -100:
                        total -= logp[r, t - 1, y[r, t]].item()
                        count += 1
    assert count == 2 * 11 + 11
    assert loss == pytest.approx(total / count, rel=1e-5)

    # already-shifted labels give the same value
    shifted = [(a[:, :-1], a[:, 1:]), (b[:, :-1], b_labels[:, 1:])]
    assert validation_loss(model, shifted, shifted=True) == pytest.approx(loss, rel=1e-6)


def test_load_wikitext_local_and_unreachable(tmp_path, monkeypatch):
    p = tmp_path / "wiki.txt"
    p.write_text(" = Title = \n\n Some text .\n")
    assert load_wikitext(local_path=p) == " = Title = \n\n Some text .\n"

    import fusedkv.eval.perplexity as ppl

    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(ppl, "hub_unreachable_reason", lambda **kw: "the hub is unreachable (test)")
    with pytest.raises(RuntimeError, match="unreachable"):
        load_wikitext()
