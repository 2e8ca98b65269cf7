"""fusedkv.data: documents -> tokenizer -> memory-mapped token shards -> training/eval batches.

Typical use (the default offline run on the packaged Shakespeare + KJV corpus)::

    from fusedkv.data import prepare_dataset, TokenBatches, iter_eval_batches

    ds = prepare_dataset("builtin", "runs/data/builtin-8k", vocab_size=8192)
    train = TokenBatches(ds.train, seq_len=512, batch_size=8, seed=0, rank=rank, world_size=world)
    input_ids, labels = next(train)
    for x, y in iter_eval_batches(ds.val, seq_len=512, batch_size=8, max_batches=20):
        ...

Modules: :mod:`.sources` (the corpora: documents), :mod:`.specs` (spec string -> source),
:mod:`.synthetic` (generated retrieval documents), :mod:`.ruler_tasks` (RULER-style prompts),
:mod:`.tokenizer` (BPE training/loading), :mod:`.shards` (the ``.bin`` token files + metadata),
:mod:`.prepare` (tokenise a source into them), :mod:`.loader` (batch sampling).
"""

from .loader import TokenBatches, iter_eval_batches, num_eval_windows
from .prepare import prepare_dataset
from .shards import (
    PreparedDataset,
    ShardWriter,
    TokenShard,
    dtype_for_vocab,
    load_prepared_dataset,
)
from .sources import (
    BUILTIN_VAL_DOCS,
    BuiltinSource,
    HFSource,
    JsonlSource,
    ParquetSource,
    Source,
    TextSource,
    read_builtin_text,
    read_text_file,
)
from .specs import iter_documents, resolve_source
from .tokenizer import (
    EOS_TOKEN,
    PAD_TOKEN,
    load_tokenizer,
    save_tokenizer,
    tokenizer_sha256,
    train_bpe_tokenizer,
)

__all__ = [
    "BUILTIN_VAL_DOCS",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "BuiltinSource",
    "HFSource",
    "JsonlSource",
    "ParquetSource",
    "PreparedDataset",
    "ShardWriter",
    "Source",
    "TextSource",
    "TokenBatches",
    "TokenShard",
    "dtype_for_vocab",
    "iter_documents",
    "iter_eval_batches",
    "load_prepared_dataset",
    "load_tokenizer",
    "num_eval_windows",
    "prepare_dataset",
    "read_builtin_text",
    "read_text_file",
    "resolve_source",
    "save_tokenizer",
    "tokenizer_sha256",
    "train_bpe_tokenizer",
]
