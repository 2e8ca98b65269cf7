"""Getting a run's data ready: resolve the prepared-data directory, check the vocabulary, prepare.

`fusedkv.data.prepare_dataset` does the work (BPE training, tokenising into memory-mapped shards);
this module decides *where* (by default `runs/data/<source>-v<vocab>`, shared by all runs, named
after the source and the vocabulary so runs that differ in either never overwrite each other's
shards) and checks everything that would otherwise
fail late or silently *before* anything is written:

* a data path that does not exist, or a corpus with no text -> ValueError from the data package;
* a tokenizer (given, taken from `--init-from`, or recorded in an existing prepared directory)
  with more tokens than the model's `vocab_size` -> ValueError with the numbers and the fix. Fewer is
  fine: checkpoints often pad the embedding table past the tokenizer (Llama, Qwen2.5, DeepSeek round
  it to a multiple of 64 or more), and the padded rows are simply never a target.

In distributed runs rank 0 prepares and the other ranks open the finished directory.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..data import load_prepared_dataset, load_tokenizer, prepare_dataset, resolve_source
from ..data.tokenizer import tokenizer_sha256
from ..utils import slug

DATA_DIR_ENV = "FUSEDKV_DATA_DIR"


def default_data_root() -> Path:
    """Where prepared datasets go unless `data_dir` is given: $FUSEDKV_DATA_DIR, else runs/data under
    the current directory (next to the default run directories). Shared by every run, so the many
    runs of an experiment (plans x seeds) tokenise a corpus once; the directory name carries the
    source and the vocabulary, so different requests never share a directory."""
    return Path(os.environ.get(DATA_DIR_ENV) or Path("runs") / "data")


def is_prepared_dir(path: str | Path | None) -> bool:
    return path is not None and Path(str(path)).is_dir() and (Path(str(path)) / "meta.json").is_file()


def has_tokenizer(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))


def _slug(spec: str) -> str:
    """A readable, filesystem-safe name for a source spec, unique per spec (short hash suffix)."""
    if spec == "builtin":
        return "builtin"
    p = Path(spec)
    base = p.name if p.exists() else spec
    ident = str(p.resolve()) if p.exists() else spec
    name = slug(base, max_len=40, lower=False) or "data"
    return f"{name}-{hashlib.sha256(ident.encode()).hexdigest()[:8]}"


def vocab_mismatch(what: str, found: int, vocab_size: int) -> ValueError:
    return ValueError(
        f"{what} has a vocabulary of {found} tokens but the model's vocab_size is {vocab_size}; the "
        f"embedding and LM head need a row for every token. Set vocab_size={found} (--set vocab_size={found}) "
        "or use a tokenizer of at most the model's size"
    )


def too_big(found: int, vocab_size: int) -> bool:
    """Data of `found` token ids cannot feed a model of `vocab_size` rows (a smaller, padded-to tokenizer can)."""
    return found > vocab_size


def plan_data(cfg, vocab_size: int) -> tuple[str, Path, object | None]:
    """(source spec, prepared dir, tokenizer or None) for a run, after every check that can fail.

    Raises ValueError for a missing source, a tokenizer larger than the model's vocabulary, or an existing
    prepared directory of such a tokenizer. Writes nothing."""
    spec = str(cfg.data)
    if is_prepared_dir(spec):
        meta = json.loads((Path(spec) / "meta.json").read_text())
        if too_big(int(meta["vocab_size"]), vocab_size):
            raise vocab_mismatch(f"the prepared data in {spec}", int(meta["vocab_size"]), vocab_size)
        if cfg.tokenizer is not None and tokenizer_sha256(load_tokenizer(cfg.tokenizer)) != meta.get(
            "tokenizer_sha256"
        ):
            raise ValueError(
                f"the prepared data in {spec} was tokenised with another tokenizer than {cfg.tokenizer}; "
                "give the raw source as data (it is re-tokenised) or data prepared with that tokenizer"
            )
        return spec, Path(spec), None
    resolve_source(spec)  # a missing path or unknown spec fails here, with the data package's message
    tokenizer = None
    if cfg.tokenizer is not None:
        tokenizer = load_tokenizer(cfg.tokenizer)
        if too_big(len(tokenizer), vocab_size):
            raise vocab_mismatch(f"tokenizer {cfg.tokenizer}", len(tokenizer), vocab_size)
    if cfg.data_dir is not None:
        data_dir = Path(cfg.data_dir)
    else:
        root = default_data_root()
        suffix = f"v{vocab_size}" if tokenizer is None else f"tok-{tokenizer_sha256(tokenizer)[:10]}"
        data_dir = root / f"{_slug(spec)}-{suffix}"
    if is_prepared_dir(data_dir):
        # An existing dataset of a vocabulary the model cannot hold: refuse now, not after tokenising.
        meta = json.loads((data_dir / "meta.json").read_text())
        if too_big(int(meta["vocab_size"]), vocab_size):
            raise vocab_mismatch(
                f"the prepared data already in data_dir={data_dir}", int(meta["vocab_size"]), vocab_size
            )
    return spec, data_dir, tokenizer


def prepare(spec: str, data_dir: Path, vocab_size: int, tokenizer=None):
    """Prepare (or reuse) the dataset and check the tokenizer that came out of it."""
    if is_prepared_dir(spec):
        ds = load_prepared_dataset(spec)
    else:
        ds = prepare_dataset(spec, data_dir, vocab_size=vocab_size, tokenizer=tokenizer)
    if too_big(ds.vocab_size, vocab_size):  # e.g. prepared data of a larger tokenizer
        raise vocab_mismatch(f"the tokenizer prepared in {ds.out_dir}", ds.vocab_size, vocab_size)
    return ds


def open_prepared(spec: str, data_dir: Path):
    """What ranks > 0 call once rank 0 has prepared the data."""
    return load_prepared_dataset(spec if is_prepared_dir(spec) else data_dir)
