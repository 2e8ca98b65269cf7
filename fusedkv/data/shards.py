"""Token shards: documents -> flat memory-mapped token files, with a train/validation split.

On-disk layout written by :func:`fusedkv.data.prepare.prepare_dataset` into ``out_dir``::

    tokenizer/         the tokenizer (``AutoTokenizer.from_pretrained`` loads it)
    train.bin          all training tokens, one flat array (uint16 if vocab < 65536 else uint32)
    train.meta.json    dtype, num_tokens, vocab_size, eos_id, tokenizer hash, document count
    val.bin            held-out tokens (whole documents), same format
    val.meta.json
    {train,val}.targets.bin  only for sources with TargetedText documents: one uint8 per token, 1 where
                       the token is a training target, 0 where it is context only (the loader turns
                       those labels into IGNORE_INDEX)
    meta.json          the request that produced the above + a summary; written last

Every document is followed by the EOS token, so a window sampled from the flat array sees document
boundaries exactly as the model will at inference. A flat uint16 file is the cheapest possible
format to sample random windows from (one memmap slice per sequence, no padding, no index).

Robustness: every file is written to a temporary name and moved into place with ``os.replace``;
``meta.json`` goes last and is deleted first when a rebuild starts, so a killed run never leaves
outputs that look finished. A second call with the same request finds ``meta.json`` matching and
returns at once. :class:`TokenShard` checks the file size against its metadata, so a truncated
or foreign file fails loudly instead of training on garbage.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..utils import write_json_atomic
from .tokenizer import load_tokenizer

FORMAT_VERSION = 1


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 halves disk and page-cache use whenever every id fits; uint32 otherwise."""
    return np.dtype(np.uint16) if vocab_size < 65536 else np.dtype(np.uint32)


def meta_path_for(bin_path: str | Path) -> Path:
    """``train.bin`` -> ``train.meta.json``."""
    p = Path(bin_path)
    return p.with_name(p.stem + ".meta.json")


def targets_path_for(bin_path: str | Path) -> Path:
    """``train.bin`` -> ``train.targets.bin`` (the loss mask; see the module doc)."""
    p = Path(bin_path)
    return p.with_name(p.stem + ".targets.bin")


def write_meta_json(path: Path, obj: dict) -> None:
    """Metadata, written atomically, keys sorted (so equal requests give equal files)."""
    write_json_atomic(path, obj, indent=2, sort_keys=True)


class ShardWriter:
    """Append token arrays to ``path`` (via a temp file); :meth:`close` publishes bin + metadata.
    ``targets=True`` also writes the loss mask (``write(tokens, targets=...)``, all ones when omitted)."""

    def __init__(self, path: str | Path, vocab_size: int, eos_id: int, targets: bool = False, **extra_meta):
        self.path = Path(path)
        self.dtype = dtype_for_vocab(vocab_size)
        self.vocab_size, self.eos_id, self.extra_meta = int(vocab_size), int(eos_id), extra_meta
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self.file = open(self.tmp, "wb")
        self.targets_tmp = self.tmp.with_name(self.tmp.name + ".targets") if targets else None
        self.targets_file = open(self.targets_tmp, "wb") if targets else None
        self.num_tokens = 0
        self.num_documents = 0

    def write(self, tokens, documents: int = 0, targets=None) -> None:
        arr = np.asarray(tokens)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"token id out of range [0, {self.vocab_size}) while writing {self.path}")
        self.file.write(arr.astype(self.dtype, copy=False).tobytes())
        if self.targets_file is not None:
            mask = np.ones(arr.size, np.uint8) if targets is None else np.asarray(targets, dtype=np.uint8)
            if mask.shape != (arr.size,):
                raise ValueError(f"targets of shape {mask.shape} for {arr.size} tokens while writing {self.path}")
            self.targets_file.write(mask.tobytes())
        self.num_tokens += int(arr.size)
        self.num_documents += documents

    def close(self) -> dict:
        self.file.close()
        if self.targets_file is not None:
            self.targets_file.close()
        meta = {
            "format": FORMAT_VERSION,
            "dtype": self.dtype.name,
            "num_tokens": self.num_tokens,
            "num_documents": self.num_documents,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "targets": self.targets_file is not None,
            **self.extra_meta,
        }
        # Remove stale sidecars first: a new .bin next to an old meta must never look valid.
        meta_path_for(self.path).unlink(missing_ok=True)
        targets_path_for(self.path).unlink(missing_ok=True)
        os.replace(self.tmp, self.path)
        if self.targets_tmp is not None:
            os.replace(self.targets_tmp, targets_path_for(self.path))
        write_meta_json(meta_path_for(self.path), meta)
        return meta

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)
        if self.targets_file is not None:
            self.targets_file.close()
            self.targets_tmp.unlink(missing_ok=True)


class TokenShard:
    """A read-only ``np.memmap`` view of a ``.bin`` token file, validated against its metadata."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        mpath = meta_path_for(self.path)
        if not self.path.is_file():
            raise ValueError(f"token shard {self.path} does not exist; create it with "
                             f"fusedkv.data.prepare_dataset(...).")
        if not mpath.is_file():
            raise ValueError(f"token shard {self.path} has no metadata file {mpath.name} next to it, so "
                             f"its dtype and length are unknown (an interrupted or foreign file?). "
                             f"Re-run prepare_dataset to rebuild it.")
        try:
            self.meta = json.loads(mpath.read_text())
            self.dtype = np.dtype(self.meta["dtype"])
            self.num_tokens = int(self.meta["num_tokens"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"corrupt metadata {mpath}: {e}. Re-run prepare_dataset to rebuild it.") from e
        expected = self.num_tokens * self.dtype.itemsize
        actual = self.path.stat().st_size
        if actual != expected:
            raise ValueError(
                f"token shard {self.path} is {actual} bytes but its metadata says {self.num_tokens} "
                f"{self.dtype.name} tokens = {expected} bytes: the file is truncated or corrupt. "
                f"Delete {self.path.parent} (or the shard) and re-run prepare_dataset."
            )
        # np.memmap cannot map an empty file; an empty array behaves the same for every caller.
        self.tokens = (np.memmap(self.path, dtype=self.dtype, mode="r") if self.num_tokens
                       else np.empty(0, dtype=self.dtype))
        self.targets = None  # the loss mask (uint8 per token), for shards that have one
        if self.meta.get("targets"):
            tpath = targets_path_for(self.path)
            if not tpath.is_file() or tpath.stat().st_size != self.num_tokens:
                raise ValueError(f"token shard {self.path} records a loss mask but {tpath.name} is missing or not "
                                 f"{self.num_tokens} bytes long. Delete {self.path.parent} and re-run prepare_dataset.")
            self.targets = (np.memmap(tpath, dtype=np.uint8, mode="r") if self.num_tokens
                            else np.empty(0, dtype=np.uint8))

    vocab_size = property(lambda self: int(self.meta["vocab_size"]))
    eos_id = property(lambda self: int(self.meta["eos_id"]))

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, idx):
        return self.tokens[idx]

    def __repr__(self) -> str:
        return f"TokenShard({str(self.path)!r}, num_tokens={self.num_tokens}, dtype={self.dtype.name})"


@dataclass
class PreparedDataset:
    """What :func:`prepare_dataset` produced: the shards, the tokenizer directory and the metadata."""

    out_dir: Path
    train: TokenShard
    val: TokenShard
    meta: dict

    @property
    def tokenizer_dir(self) -> Path:
        return self.out_dir / "tokenizer"

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.meta["eos_id"])

    def load_tokenizer(self):
        return load_tokenizer(self.tokenizer_dir)


def load_prepared_dataset(out_dir: str | Path) -> PreparedDataset:
    """Open a finished :func:`prepare_dataset` output (e.g. on ranks > 0 after rank 0 prepared it)."""
    out_dir = Path(out_dir)
    mpath = out_dir / "meta.json"
    if not mpath.is_file():
        raise ValueError(f"{out_dir} holds no finished dataset (no meta.json); run "
                         f"fusedkv.data.prepare_dataset(source, {str(out_dir)!r}) first.")
    meta = json.loads(mpath.read_text())
    train, val = TokenShard(out_dir / "train.bin"), TokenShard(out_dir / "val.bin")
    for shard in (train, val):
        if shard.meta.get("tokenizer_sha256") != meta["tokenizer_sha256"]:
            raise ValueError(f"{shard.path} was made with a different tokenizer than {mpath} records; "
                             f"re-run prepare_dataset.")
    return PreparedDataset(out_dir, train, val, meta)
