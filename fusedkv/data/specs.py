"""Spec strings -> document sources: the one reader of `--data` specs (`builtin`, `stdlib`, `heldout:KIND`,
a path, `hf:NAME...`, `mix:builtin:...`), above the plain sources (`fusedkv.data.sources`), the real-model
texts (`fusedkv.data.realmodel`) and the synthetic mixture (`fusedkv.data.synthetic`), which it dispatches to."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from .sources import BuiltinSource, HFSource, JsonlSource, ParquetSource, Source, TextSource
from .synthetic import MIX_PREFIX, MixtureSource


def resolve_source(spec: str | Path | Source, text_field: str = "text") -> Source:
    """Turn a spec string (``builtin``, a path, or ``hf:name[:config[:split]]``) into a :class:`Source`.

    Raises ``ValueError`` naming the problem and the accepted forms when the spec is not usable.
    """
    if isinstance(spec, Source):
        return spec
    s = str(spec)
    if s == "builtin":
        return BuiltinSource()
    if s == "stdlib" or s.startswith("heldout:"):  # real-model uptraining text (fusedkv.data.realmodel)
        from .realmodel import HeldoutSource, StdlibSource

        return StdlibSource() if s == "stdlib" else HeldoutSource(s.partition(":")[2])
    if s.startswith(MIX_PREFIX):  # the corpus + synthetic retrieval documents (fusedkv.data.synthetic)
        return MixtureSource.from_spec(s)
    if s.startswith("hf:"):
        parts = s[3:].split(":")
        if not parts[0] or len(parts) > 3:
            raise ValueError(f"bad Hugging Face spec {s!r}; expected 'hf:<name>[:<config>[:<split>]]', "
                             f"e.g. 'hf:HuggingFaceFW/fineweb-edu:sample-10BT:train'.")
        name = parts[0]
        config = parts[1] if len(parts) > 1 and parts[1] else None
        split = parts[2] if len(parts) > 2 and parts[2] else "train"
        return HFSource(name, config, split, text_field)
    path = Path(s).expanduser()
    if not path.exists():
        raise ValueError(
            f"data source {s!r} does not exist. Use 'builtin' for the packaged Shakespeare + KJV corpus, "
            f"an existing .txt file or directory of .txt files, a .jsonl or .parquet file, or "
            f"'hf:<dataset>[:<config>[:<split>]]' for a Hugging Face dataset."
        )
    suffix = path.suffix.lower()
    if path.is_dir():
        return TextSource(path)
    if suffix in (".jsonl", ".json"):
        return JsonlSource(path, text_field)
    if suffix == ".parquet":
        return ParquetSource(path, text_field)
    # Anything else is read as plain text: many corpora ship as .txt, .md, .rst or no suffix at all.
    return TextSource(path)


def iter_documents(spec: str | Path | Source, text_field: str = "text") -> Iterator[str]:
    """Iterate the non-empty documents (strings) of a source spec."""
    return iter(resolve_source(spec, text_field))
