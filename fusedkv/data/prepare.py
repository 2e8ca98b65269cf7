"""`prepare_dataset`: a source -> a tokenizer -> the train / validation token shards of `fusedkv.data.shards`.

Documents are tokenised in worker processes (each loads the same tokenizer.json, so 1 or N processes
give byte-identical output) and streamed into the shards in document order; validation holds out whole
documents (the built-in corpus: `BUILTIN_VAL_DOCS`). The on-disk layout and its robustness rules
(`meta.json` last, atomic moves) are described in `fusedkv.data.shards`.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import time
from collections import deque
from pathlib import Path

import numpy as np

from .shards import (
    FORMAT_VERSION,
    PreparedDataset,
    ShardWriter,
    dtype_for_vocab,
    load_prepared_dataset,
    write_meta_json,
)
from .sources import BUILTIN_VAL_DOCS, BuiltinSource, Source, TargetedText
from .specs import resolve_source
from .tokenizer import eos_token_id, load_tokenizer, save_tokenizer, tokenizer_sha256, train_bpe_tokenizer

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- tokenisation workers
_WORKER: dict = {}


def _init_worker(tokenizer_json: str, eos_id: int, dtype: str) -> None:
    # Each worker loads the raw `tokenizers` object from tokenizer.json: fast, and the same file in
    # every process, so 1 or N processes give byte-identical output.
    from tokenizers import Tokenizer

    _WORKER.update(tok=Tokenizer.from_file(tokenizer_json), eos=eos_id, dtype=np.dtype(dtype))


def _encode_chunk(texts: list[str]) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """(token ids + EOS, loss mask or None) per text; the mask marks the tokens overlapping a
    TargetedText's spans, the EOS after it too (the end of a document is always a target)."""
    tok, eos, dtype = _WORKER["tok"], _WORKER["eos"], _WORKER["dtype"]
    # add_special_tokens=False: no tokenizer-specific BOS/post-processing; we add exactly one EOS.
    out = []
    for text, enc in zip(texts, tok.encode_batch(texts, add_special_tokens=False)):
        arr = np.empty(len(enc.ids) + 1, dtype=dtype)
        arr[:-1] = enc.ids
        arr[-1] = eos
        mask = None
        if isinstance(text, TargetedText):
            mask = np.ones(len(arr), np.uint8)
            offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
            hit = np.zeros(len(offsets), bool)
            for a, b in text.target_spans:
                hit |= (offsets[:, 0] < b) & (offsets[:, 1] > a)
            mask[:-1] = hit
        out.append((arr, mask))
    return out


def _chunks(named_docs, is_val, max_chars: int = 1 << 20, max_docs: int = 512):
    """Group documents so each worker task is big enough to amortise inter-process overhead."""
    flags, texts, size = [], [], 0
    for name, text in named_docs:
        flags.append(is_val(name))
        texts.append(text)
        size += len(text)
        if size >= max_chars or len(texts) >= max_docs:
            yield flags, texts
            flags, texts, size = [], [], 0
    if texts:
        yield flags, texts


def _encode_all(chunks, num_proc: int, init_args: tuple):
    """Yield (flags, arrays) per chunk, in input order, with ``num_proc`` processes.

    Uses apply_async with a bounded window instead of Pool.imap because imap drains its input
    iterator eagerly, which would pull a whole streamed (HF) corpus into memory.
    """
    if num_proc <= 1:
        _init_worker(*init_args)
        for flags, texts in chunks:
            yield flags, _encode_chunk(texts)
        return
    import multiprocessing as mp

    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    # The parent may have used tokenizers' thread pool (tokenizer training); this env var, read at
    # fork, makes the children run single-threaded quietly instead of printing a fork warning.
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        pool = ctx.Pool(num_proc, initializer=_init_worker, initargs=init_args)
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old
    with pool:
        pending: deque = deque()
        for flags, texts in chunks:
            pending.append((flags, pool.apply_async(_encode_chunk, (texts,))))
            if len(pending) >= 4 * num_proc:
                f, res = pending.popleft()
                yield f, res.get()
        while pending:
            f, res = pending.popleft()
            yield f, res.get()


def _limited(named_docs, max_documents: int | None):
    for i, item in enumerate(named_docs):
        if max_documents is not None and i >= max_documents:
            return
        yield item


def _val_selector(val_docs, val_fraction: float, seed: int):
    if val_docs is not None:
        names = frozenset(val_docs)
        return lambda name: name in names
    # Hash of (seed, name): deterministic, independent of order and of num_proc, works on a stream.
    threshold = int(val_fraction * 2**64)

    def is_val(name: str) -> bool:
        digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
        return int.from_bytes(digest[:8], "big") < threshold

    return is_val


# ----------------------------------------------------------------------------- the whole pipeline
def _one_at_a_time(prepare):
    """Two processes asked for the same dataset at once (two `fusedkv compare` started together, one per core):
    the second waits on an exclusive `flock` in the output folder, then finds the first one's output finished
    and reuses it, instead of both writing the same files. The kernel releases the lock when its process ends."""

    @functools.wraps(prepare)
    def locked(source_spec, out_dir, *args, **kwargs):
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(out_dir) / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return prepare(source_spec, out_dir, *args, **kwargs)

    return locked


@_one_at_a_time
def prepare_dataset(
    source_spec: str | Path | Source,
    out_dir: str | Path,
    vocab_size: int = 8192,
    tokenizer=None,
    val_fraction: float = 0.05,
    num_proc: int = 2,
    seed: int = 0,
    *,
    val_docs="default",
    text_field: str = "text",
    max_documents: int | None = None,
    tokenizer_max_chars: int | None = None,
    overwrite: bool = False,
) -> PreparedDataset:
    """Tokenise a source into ``out_dir/{train,val}.bin`` (+ tokenizer, metadata); see module doc.

    * ``tokenizer``: None trains a byte-level BPE of ``vocab_size`` on the *training* documents only
      (so nothing about the held-out text leaks in); otherwise a tokenizer directory, hub name or
      tokenizer object, copied into ``out_dir/tokenizer`` (``vocab_size`` is then ignored).
    * Validation = whole documents. ``val_docs="default"``: the names in ``BUILTIN_VAL_DOCS`` for the
      builtin corpus, else a ``val_fraction`` of documents chosen by a hash of (seed, name). A list of
      names holds out exactly those (all must exist); None forces the fraction rule. If the fraction
      rule picks no document (e.g. a single file), the last ``val_fraction`` of the training tokens
      becomes the validation shard instead (``meta["val_split"] == "token_tail"``).
    * Idempotent: returns the existing output when ``meta.json`` records the same request.
    """
    t0 = time.time()
    src = resolve_source(source_spec, text_field)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}.")
    if isinstance(val_docs, str) and val_docs == "default":
        val_docs = BUILTIN_VAL_DOCS if isinstance(src, BuiltinSource) else getattr(src, "val_docs", None)
    val_names = None if val_docs is None else sorted(set(val_docs))

    tok_obj = None
    if tokenizer is not None:
        tok_obj = load_tokenizer(tokenizer)
        vocab_size = len(tok_obj)
    request = {
        "format": FORMAT_VERSION,
        "source": src.fingerprint(),
        "vocab_size": int(vocab_size),
        "tokenizer": None if tok_obj is None else tokenizer_sha256(tok_obj),
        "val_docs": val_names,
        "val_fraction": None if val_names is not None else float(val_fraction),
        "seed": None if val_names is not None else int(seed),
        "max_documents": max_documents,
        "tokenizer_max_chars": None if tok_obj is not None else tokenizer_max_chars,
    }
    meta_file = out_dir / "meta.json"
    if meta_file.is_file() and not overwrite:
        try:
            done = load_prepared_dataset(out_dir)
            if done.meta.get("request") == request:
                log.info("reusing prepared dataset in %s", out_dir)
                return done
        except (ValueError, KeyError, json.JSONDecodeError):
            pass  # stale or damaged: rebuild below
    meta_file.unlink(missing_ok=True)  # from here on, nothing in out_dir may look finished

    is_val = _val_selector(val_names, val_fraction, seed)
    tok_dir = out_dir / "tokenizer"
    if tok_obj is None:
        log.info("training a %d-token byte-level BPE on %s", vocab_size, src.spec)
        train_docs = (t for n, t in _limited(src.iter_named(), max_documents) if not is_val(n))
        tok_obj = train_bpe_tokenizer(train_docs, vocab_size, tok_dir, max_chars=tokenizer_max_chars)
    else:
        save_tokenizer(tok_obj, tok_dir)
    tok_hash = tokenizer_sha256(tok_obj)
    vocab = len(tok_obj)
    eos = eos_token_id(tok_obj)
    common = {"tokenizer": "tokenizer", "tokenizer_sha256": tok_hash}

    targets = src.has_targets  # decided once: both shards carry a loss mask, or neither does
    writers = {False: ShardWriter(out_dir / "train.bin", vocab, eos, targets, split="train", **common),
               True: ShardWriter(out_dir / "val.bin", vocab, eos, targets, split="val", **common)}
    seen_val: list[str] = []

    def named_docs():
        for name, text in _limited(src.iter_named(), max_documents):
            if is_val(name):
                seen_val.append(name)
            yield name, text

    try:
        init = (str(tok_dir / "tokenizer.json"), eos, dtype_for_vocab(vocab).name)
        for flags, arrays in _encode_all(_chunks(named_docs(), is_val), num_proc, init):
            for flag, (arr, mask) in zip(flags, arrays, strict=True):
                writers[flag].write(arr, documents=1, targets=mask)
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    if val_names is not None and set(seen_val) != set(val_names):
        for w in writers.values():
            w.abort()
        missing = sorted(set(val_names) - set(seen_val))
        raise ValueError(f"held-out document names not found in {src.spec!r}: {missing}. "
                         f"Names look like {BUILTIN_VAL_DOCS[0]!r}; check the spelling.")
    val_split = "documents"
    if writers[False].num_documents == 0 and not getattr(src, "eval_only", False):  # heldout:KIND is all validation
        for w in writers.values():
            w.abort()
        raise ValueError(f"every document of {src.spec!r} was held out for validation; lower "
                         f"val_fraction or hold out fewer val_docs.")
    if writers[True].num_documents == 0:
        val_split = "token_tail"
        _move_tail(writers[False], writers[True], val_fraction)
    train_meta, val_meta = writers[False].close(), writers[True].close()
    meta = {
        "format": FORMAT_VERSION,
        "request": request,
        "source_spec": src.spec,
        "vocab_size": vocab,
        "dtype": dtype_for_vocab(vocab).name,
        "eos_id": eos,
        "pad_id": tok_obj.pad_token_id,
        **common,
        "val_split": val_split,
        "val_documents": sorted(seen_val)[:1000],  # capped: a huge corpus would bloat the file
        "train": {k: train_meta[k] for k in ("num_tokens", "num_documents")},
        "val": {k: val_meta[k] for k in ("num_tokens", "num_documents")},
        "seconds": round(time.time() - t0, 2),
    }
    write_meta_json(meta_file, meta)
    log.info("prepared %s: %d train / %d val tokens in %.1fs", out_dir,
             train_meta["num_tokens"], val_meta["num_tokens"], meta["seconds"])
    return load_prepared_dataset(out_dir)


def _move_tail(train: ShardWriter, val: ShardWriter, fraction: float) -> None:
    """Move the last ``fraction`` of the train tokens (at least 2) to ``val`` (fallback split)."""
    train.file.flush()
    n_val = max(2, int(np.ceil(train.num_tokens * fraction)))
    if train.num_tokens - n_val < 2:
        raise ValueError(f"only {train.num_tokens} tokens in total: too little text for a validation split.")
    cut = train.num_tokens - n_val
    tail = np.fromfile(train.tmp, dtype=train.dtype, offset=cut * train.dtype.itemsize)
    train.file.truncate(cut * train.dtype.itemsize)
    tail_targets = None
    if train.targets_file is not None:
        train.targets_file.flush()
        tail_targets = np.fromfile(train.targets_tmp, dtype=np.uint8, offset=cut)
        train.targets_file.truncate(cut)
    train.num_tokens = cut
    val.write(tail, documents=0, targets=tail_targets)
