"""Perplexity and validation loss of a causal LM (the paper's "valid loss" and "WikiText PPL" columns).

* :func:`sliding_window_perplexity` is the standard Hugging Face strided evaluation of a long token
  stream: windows of ``max_length`` tokens start every ``stride`` tokens; the first window scores all
  of its tokens, every later window scores only the tokens that no earlier window scored (its last
  ``stride`` positions), so each token 1..N-1 is scored exactly once and gets ``max_length - stride``
  or more tokens of context. ``stride == max_length - 1`` is non-overlapping evaluation.
* :func:`validation_loss` is the token-weighted mean cross-entropy over a stream of batches.
* :func:`text_perplexity` tokenizes a string and calls the sliding-window routine;
  :func:`load_wikitext` fetches WikiText from the hub (or a local file) for it.

Models are Hugging Face-style causal LMs: ``model(input_ids, attention_mask=...)`` returns an object
with ``.logits`` of shape ``[B, T, V]`` for all positions (both ``transformers`` models and
``fusedkv``'s own ``FusedKVForCausalLM``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ..errors import RunError
from ..model.loss import lm_loss, shift_labels
from ..utils import hub_unreachable_reason
from ..utils import model_device as _model_device


def _forward_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    # use_cache=False: we want the logits of every position from one pass, and building a KV cache
    # would only cost memory (and for FusedKV would exercise the decode path, not what is measured).
    try:
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    except TypeError:  # a model whose forward has no use_cache argument builds no cache anyway
        out = model(input_ids=input_ids, attention_mask=attention_mask)
    return out.logits if hasattr(out, "logits") else out[0]


def _token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-position NLL (fusedkv.model.loss, the package's one LM loss); positions whose target is -100
    give 0. Computed in fp32 for stable sums."""
    return lm_loss(logits, targets, reduction="none")


def _windows(n: int, max_length: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored) for each window over a stream of n tokens (HF's strided loop).

    Window ``[begin, end)`` predicts target positions ``first_scored .. end-1`` (a target at position t
    is predicted from tokens ``begin .. t-1``). Position 0 has no context and is never a target.
    """
    out = []
    prev_end = 0
    for begin in range(0, n, stride):
        end = min(begin + max_length, n)
        first = max(prev_end, begin + 1)
        if first < end:
            out.append((begin, end, first))
        prev_end = end
        if end == n:
            break
    return out


@torch.no_grad()
def sliding_window_perplexity(
    model,
    token_ids: torch.Tensor,
    max_length: int,
    stride: int,
    batch_size: int = 1,
    device: str | torch.device | None = None,
) -> dict[str, float]:
    """Strided sliding-window perplexity of one token stream.

    Args:
        model: HF-style causal LM (put it in eval mode first; it is not switched here).
        token_ids: 1-D LongTensor, the whole evaluation text tokenized as one stream.
        max_length: window length (the model's evaluation context).
        stride: step between window starts. Tokens ``1..N-1`` are each scored exactly once. A stride
            of ``max_length`` or more would leave every later window's first token without context
            (HF's loop silently drops those tokens); it is clamped to ``max_length - 1`` instead.
        batch_size: windows per forward pass (all full windows have the same length; the shorter
            last window is right-padded, which a causal model ignores for the real positions).
        device: where to run; defaults to the model's device.

    Returns:
        ``{"nll_sum", "num_tokens", "ppl"}`` with ``ppl = exp(nll_sum / num_tokens)``.
    """
    if token_ids.dim() != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
    n = token_ids.numel()
    if n < 2:
        raise ValueError("need at least two tokens to score anything")
    if max_length < 2:
        raise ValueError("max_length must be >= 2")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    stride = max(1, min(stride, max_length - 1))
    device = torch.device(device) if device is not None else _model_device(model)
    ids = token_ids.to(torch.long)

    nll_sum = 0.0
    num_tokens = 0
    wins = _windows(n, max_length, stride)
    for i in range(0, len(wins), batch_size):
        group = wins[i : i + batch_size]
        width = max(end - begin for begin, end, _ in group)
        inp = torch.full((len(group), width), 0, dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        tgt = torch.full((len(group), width), -100, dtype=torch.long)
        for row, (begin, end, first) in enumerate(group):
            w = end - begin
            inp[row, :w] = ids[begin:end]
            mask[row, :w] = 1
            # logits at window position j predict the token at position j+1
            j0 = first - begin - 1
            tgt[row, j0 : w - 1] = ids[first:end]
        logits = _forward_logits(model, inp.to(device), mask.to(device))
        nll = _token_nll(logits, tgt.to(device))
        nll_sum += float(nll.sum(dtype=torch.float64))
        num_tokens += int((tgt != -100).sum())

    _check_finite(nll_sum, "the sliding-window loss")
    return {"nll_sum": nll_sum, "num_tokens": num_tokens, "ppl": math.exp(nll_sum / num_tokens)}


def _check_finite(loss: float, what: str) -> None:
    """A NaN or infinite loss is a failure (corrupt weights, an overflow), never a number to report."""
    if not math.isfinite(loss):
        raise RunError(f"{what} is {loss}: the model's logits are not finite (corrupt or diverged weights, or an "
                       "overflow in this dtype); check the checkpoint, or evaluate in float32")


def _unpack_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if isinstance(batch, dict):
        return batch["input_ids"], batch["labels"], batch.get("attention_mask")
    if len(batch) == 3:
        return batch[0], batch[1], batch[2]
    return batch[0], batch[1], None


@torch.no_grad()
def validation_loss(
    model,
    batches: Iterable,
    shifted: bool = False,
    device: str | torch.device | None = None,
    max_batches: int | None = None,
) -> float:
    """Mean token cross-entropy (nats) over batches, weighted by token count (not a mean of means).

    Each batch is ``(input_ids, labels)``, ``(input_ids, labels, attention_mask)`` or a dict with those
    keys. ``labels`` use the Hugging Face convention by default: aligned with ``input_ids`` (often a
    copy of it), the model's logits at position t are scored against ``labels[t+1]``, and -100 marks
    ignored positions. With ``shifted=True`` the labels are already next-token targets
    (``labels[t]`` is the target of ``logits[t]``, GPT-style data loaders).
    """
    device = torch.device(device) if device is not None else _model_device(model)
    total, count = 0.0, 0
    for k, batch in enumerate(batches):
        if max_batches is not None and k >= max_batches:
            break
        input_ids, labels, mask = _unpack_batch(batch)
        input_ids, labels = input_ids.to(device), labels.to(device)
        logits = _forward_logits(model, input_ids, mask.to(device) if mask is not None else None)
        if not shifted:  # transformers' convention -> the loss's (targets[t] scores logits[t])
            labels = shift_labels(labels)
        nll = _token_nll(logits, labels)
        total += float(nll.sum(dtype=torch.float64))
        count += int((labels != -100).sum())
    if count == 0:
        raise ValueError("no scored tokens in the validation batches")
    _check_finite(total, "the validation loss")
    return total / count


def text_perplexity(
    model,
    tokenizer,
    text: str,
    max_length: int,
    stride: int,
    batch_size: int = 1,
    device: str | torch.device | None = None,
) -> dict[str, float]:
    """Tokenize ``text`` as one stream (no special tokens added) and run the sliding-window evaluation.

    Special tokens are not added because the text is one long document cut into windows: a BOS would
    sit at the stream start only, and the HF recipe tokenizes the joined text the same way.
    """
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return sliding_window_perplexity(model, torch.tensor(ids, dtype=torch.long), max_length, stride,
                                     batch_size=batch_size, device=device)


def _read_local_text(path: Path) -> str:
    # A local copy can be the raw text (.txt/.raw/.tokens), or a datasets export with a "text" column.
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".parquet", ".arrow"):
        import datasets

        kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}[suffix]
        ds = datasets.load_dataset(kind, data_files=str(path), split="train")
        return "\n\n".join(ds["text"])
    return path.read_text(encoding="utf-8")


def load_wikitext(
    name: str = "wikitext-2-raw-v1",
    split: str = "test",
    local_path: str | os.PathLike | None = None,
    probe_timeout: float = 3.0,
) -> str:
    """WikiText ``split`` as one string, joined the way the HF perplexity recipe does (``"\\n\\n"``).

    With ``local_path`` the text is read from that file and nothing is downloaded. Otherwise the
    dataset comes from ``datasets.load_dataset("wikitext", name, split=split)``: in offline mode
    (``HF_DATASETS_OFFLINE=1``) only a cached copy can be used; online, the hub is probed first so that
    an unreachable hub raises a clear ``RuntimeError`` within ``probe_timeout`` seconds.
    """
    if local_path is not None:
        return _read_local_text(Path(local_path))
    if hub_unreachable_reason(timeout=probe_timeout) is not None:  # None in offline mode: the cache decides
        raise RuntimeError(
            f"WikiText ({name}, {split}) must come from the Hugging Face hub, which is unreachable from "
            "this machine. Pass local_path= to a local copy (raw .txt, or .jsonl/.parquet with a 'text' "
            "column), or set HF_DATASETS_OFFLINE=1 to use a copy already in the datasets cache."
        )
    import datasets

    try:
        ds = datasets.load_dataset("wikitext", name, split=split)
    except Exception as e:  # offline without a cached copy, or a hub error
        raise RuntimeError(f"could not load WikiText {name}/{split}: {e}. Pass local_path= to a local copy.") \
            from e
    return "\n\n".join(ds["text"])


def wikitext_perplexity(
    model,
    tokenizer,
    max_length: int = 2048,
    stride: int = 512,
    name: str = "wikitext-2-raw-v1",
    local_path: str | os.PathLike | None = None,
    batch_size: int = 1,
) -> dict[str, float]:
    """WikiText test perplexity with the sliding-window protocol (the paper's "WikiText PPL" column)."""
    text = load_wikitext(name=name, split="test", local_path=local_path)
    return text_perplexity(model, tokenizer, text, max_length, stride, batch_size=batch_size)
