"""Document sources: turn a short spec string into an iterator of text documents.

Training data for fusedkv is a stream of *documents* (plain strings). A document is the unit that
is kept whole when holding out validation data and that is terminated by the EOS token in the
token shards, so every source also gives each document a stable *name* (``iter_named()``), which the
validation split and the metadata use.

Supported specs (`fusedkv.data.specs.resolve_source` reads them):

* ``builtin`` -- the corpus shipped in ``fusedkv/data/corpus``: 42 Shakespeare works (one document
  each) and the King James Bible split into its 66 books (one document per book).
* ``path/to/file.txt`` -- one document (the whole file).
* ``path/to/dir`` -- every ``*.txt`` below the directory, one document per file, in sorted order.
* ``x.jsonl`` -- one document per line, from a text field (``text`` unless configured).
* ``x.parquet`` -- one document per row, from a text column, streamed in record batches.
* ``hf:<name>[:<config>[:<split>]]`` -- a Hugging Face hub dataset, read with ``streaming=True``
  so that nothing is downloaded up front (e.g. ``hf:HuggingFaceFW/fineweb-edu:sample-10BT:train``).

Whitespace-only documents are skipped; a source that yields no non-empty document raises
``ValueError`` when it is iterated, and a missing path raises ``ValueError`` when it is resolved,
so that a typo fails at once with a message saying how to fix it rather than deep inside training.
Text must be UTF-8: a file that is mostly not (random bytes, an executable) is refused naming it
(:func:`read_text_file`); a few stray bytes are replaced with a warning naming the file and line; a
.jsonl line that is not UTF-8 is an error naming the file and line.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import lzma
import re
import tarfile
from collections.abc import Iterator
from pathlib import Path

from ..utils import hub_offline_mode, hub_unreachable_reason  # noqa: F401 (used here and re-exported)

# Whole works/books held out from the built-in corpus (~4.8% of its text): a tragedy, a comedy and
# the poems from Shakespeare; narrative, prophecy, gospel and epistle from the Bible. Whole
# documents, so validation measures generalisation to unseen text, not to unseen lines of seen text.
BUILTIN_VAL_DOCS = (
    "shakespeare/macbeth",
    "shakespeare/tempest",
    "shakespeare/sonnets",
    "kjv/Ruth",
    "kjv/Jonah",
    "kjv/Mark",
    "kjv/Romans",
)

log = logging.getLogger(__name__)

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
SHAKESPEARE_ARCHIVE = CORPUS_DIR / "shakespeare-works.tar.xz"
KJV_FILE = CORPUS_DIR / "kjv.txt.xz"

# A KJV chapter heading is "<Book> <chapter>" alone on a line, e.g. "Genesis 1", "1 Samuel 3",
# "Song of Solomon 8". Verse lines start with spaces and wrapped verse text never stands alone
# between two blank lines, so requiring the blank lines makes the match unambiguous (it finds
# exactly the Bible's 1189 chapters).
_KJV_HEADING = re.compile(r"(?:\A|\n\n)((?:[1-3] )?[A-Z][A-Za-z ]*?) (\d+)\n\n")


# Above this share of undecodable bytes and control characters a file is binary, not text with a few bad
# bytes: random bytes score ~50%, executables well above 10%, a Latin-1 text mistaken for UTF-8 ~1-3%.
BINARY_FRACTION = 0.10
# Bytes that never occur in text: C0 controls other than tab, newline, vertical tab, form feed and
# carriage return, and DEL. bytes.translate deletes all others, leaving just these to count.
_TEXT_BYTES = bytes(b for b in range(256) if not (b < 32 and b not in b"\t\n\x0b\x0c\r") and b != 127)


def read_text_file(path: str | Path) -> str:
    """The UTF-8 text of a file. Refuses, naming the file, one that is mostly not text; replaces a few
    undecodable bytes (with a warning naming the file and the first bad line) rather than abort a long run."""
    path = Path(path)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
        first_bad = None
    except UnicodeDecodeError as e:
        text = data.decode("utf-8", errors="replace")
        first_bad = e.start
    undecodable = 0 if first_bad is None else text.count("\ufffd")
    control = len(data.translate(None, _TEXT_BYTES))
    if undecodable + control > BINARY_FRACTION * max(1, len(text)):
        if first_bad is None:
            first_bad = len(data) - len(data.lstrip(_TEXT_BYTES))
        line = data[:first_bad].count(b"\n") + 1
        share = 100 * (undecodable + control) / max(1, len(text))
        raise ValueError(
            f"{path} does not look like text: {share:.0f}% of it is undecodable bytes or control characters "
            f"(from line {line}). fusedkv reads UTF-8 text; pass text files (a text file in another encoding: "
            f"convert it first, e.g. iconv -f LATIN1 -t UTF-8)."
        )
    if first_bad is not None:
        line = data[:first_bad].count(b"\n") + 1
        log.warning("%s: %d bytes are not UTF-8 (first on line %d); read them as U+FFFD. Convert the file to "
                    "UTF-8 to keep those characters.", path, undecodable, line)
    return text


class TargetedText(str):
    """A document's text that also says which characters the loss counts on: `target_spans`, [start, end)
    character spans. Tokens overlapping a span are training targets, every other token is context only (a
    synthetic retrieval document trained on its answers, as Zoology trains MQAR). A plain str counts in full."""

    target_spans: tuple[tuple[int, int], ...]

    def __new__(cls, text: str, target_spans):
        self = super().__new__(cls, text)
        self.target_spans = tuple((int(a), int(b)) for a, b in target_spans)
        return self

    def __reduce__(self):  # pickled whole to the tokenising worker processes
        return (TargetedText, (str(self), self.target_spans))


class Source:
    """Base class: a re-iterable collection of named text documents.

    Subclasses implement :meth:`_iter_raw`; this class filters out empty documents and turns "no
    documents at all" into a clear error. Iterating a source yields only the texts; use
    :meth:`iter_named` for ``(name, text)`` pairs.
    """

    spec: str = ""
    # True when some documents are TargetedText: prepare_dataset then writes a loss mask next to the tokens.
    has_targets: bool = False

    def _iter_raw(self) -> Iterator[tuple[str, str]]:
        raise NotImplementedError

    def iter_named(self) -> Iterator[tuple[str, str]]:
        count = 0
        for name, text in self._iter_raw():
            if text is None or not str(text).strip():
                continue
            count += 1
            yield name, text if isinstance(text, str) else str(text)
        if count == 0:
            raise ValueError(
                f"data source {self.spec!r} contains no non-empty documents. "
                f"{self._empty_hint()}"
            )

    def __iter__(self) -> Iterator[str]:
        for _, text in self.iter_named():
            yield text

    def fingerprint(self) -> str:
        """A cheap identity of the data (used to decide whether prepared shards are still valid)."""
        return self.spec

    def _empty_hint(self) -> str:
        return "Point the source at files that contain text."

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"


def _file_fingerprint(paths: list[Path], root: Path) -> str:
    # Size + mtime of every file: changes when the data changes, without reading gigabytes.
    h = hashlib.sha256()
    for p in paths:
        st = p.stat()
        h.update(f"{p.relative_to(root) if p != root else p.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


class BuiltinSource(Source):
    """The packaged corpus: Shakespeare (one document per work) + KJV Bible (one per book)."""

    spec = "builtin"

    def _iter_raw(self) -> Iterator[tuple[str, str]]:
        yield from iter_shakespeare()
        yield from iter_kjv_books()

    def fingerprint(self) -> str:
        return "builtin:" + _file_fingerprint([SHAKESPEARE_ARCHIVE, KJV_FILE], CORPUS_DIR)

    def _empty_hint(self) -> str:
        return f"The packaged corpus in {CORPUS_DIR} looks damaged; reinstall fusedkv."


def iter_shakespeare() -> Iterator[tuple[str, str]]:
    """Yield ``("shakespeare/<work>", text)`` for each work in the packaged archive, sorted by name."""
    with tarfile.open(SHAKESPEARE_ARCHIVE, "r:xz") as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and m.name.endswith(".txt")),
                         key=lambda m: m.name)
        for m in members:
            f = tar.extractfile(m)
            assert f is not None
            text = f.read().decode("utf-8")
            yield "shakespeare/" + Path(m.name).stem, text


def iter_kjv_books() -> Iterator[tuple[str, str]]:
    """Yield ``("kjv/<Book>", text)`` for the 66 books of the King James Bible, in canonical order.

    The file has one heading line ``<Book> <chapter>`` before each chapter; a new book begins
    where the book name in the heading changes. The headings are kept in the text (they are part of
    the printed Bible and tell the model where chapters begin).
    """
    with lzma.open(KJV_FILE, "rt", encoding="utf-8") as f:
        # The file opens with a blank line; strip it so the first heading matches at \A.
        text = f.read().lstrip("\n")
    book_starts: list[tuple[str, int]] = []
    for m in _KJV_HEADING.finditer(text):
        book = m.group(1)
        if not book_starts or book_starts[-1][0] != book:
            book_starts.append((book, m.start(1)))
    for i, (book, start) in enumerate(book_starts):
        end = book_starts[i + 1][1] if i + 1 < len(book_starts) else len(text)
        yield "kjv/" + book, text[start:end].strip("\n") + "\n"


class TextSource(Source):
    """A single ``.txt`` file (one document) or a directory of ``*.txt`` files (one per file)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.spec = str(path)
        if self.path.is_dir():
            # Sorted so that the document order (and hence the shards) is reproducible.
            self.files = sorted(p for p in self.path.rglob("*.txt") if p.is_file())
            if not self.files:
                raise ValueError(
                    f"directory {self.spec!r} contains no .txt files. Put one plain-text document per "
                    f"*.txt file in it, or pass a .jsonl/.parquet file, or use the spec 'builtin'."
                )
        else:
            self.files = [self.path]

    def _iter_raw(self) -> Iterator[tuple[str, str]]:
        root = self.path if self.path.is_dir() else self.path.parent
        for p in self.files:
            yield str(p.relative_to(root)), read_text_file(p)

    def fingerprint(self) -> str:
        root = self.path if self.path.is_dir() else self.path.parent
        return f"text:{self.path.resolve()}:{_file_fingerprint(self.files, root)}"

    def _empty_hint(self) -> str:
        return "All the .txt files are empty or whitespace; add text to them."


class JsonlSource(Source):
    """A JSON-lines file: one JSON object per line, the document in ``text_field``."""

    def __init__(self, path: str | Path, text_field: str = "text"):
        self.path = Path(path)
        self.spec = str(path)
        self.text_field = text_field

    def _iter_raw(self) -> Iterator[tuple[str, str]]:
        with open(self.path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{self.spec}:{lineno}: not UTF-8 (byte {raw[e.start]:#04x} at column "
                                     f"{e.start + 1}); JSON lines must be UTF-8 text.") from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{self.spec}:{lineno}: not valid JSON ({e}).") from e
                if not isinstance(record, dict) or self.text_field not in record:
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise ValueError(
                        f"{self.spec}:{lineno}: no field {self.text_field!r} (found {keys}). "
                        f"Pass text_field=<name of the field holding the document text>."
                    )
                yield f"{self.path.name}:{lineno}", record[self.text_field]

    def fingerprint(self) -> str:
        return f"jsonl:{self.path.resolve()}:{self.text_field}:{_file_fingerprint([self.path], self.path)}"

    def _empty_hint(self) -> str:
        return f"Every {self.text_field!r} field is empty or whitespace."


class ParquetSource(Source):
    """A parquet file, one document per row from column ``text_field``; read in record batches so a
    large file is never loaded whole into memory."""

    def __init__(self, path: str | Path, text_field: str = "text"):
        self.path = Path(path)
        self.spec = str(path)
        self.text_field = text_field

    def _iter_raw(self) -> Iterator[tuple[str, str]]:
        import pyarrow.parquet as pq  # pyarrow is a dependency of `datasets`

        pf = pq.ParquetFile(self.path)
        if self.text_field not in pf.schema_arrow.names:
            raise ValueError(
                f"{self.spec}: no column {self.text_field!r} (columns: {pf.schema_arrow.names}). "
                f"Pass text_field=<name of the column holding the document text>."
            )
        row = 0
        for batch in pf.iter_batches(batch_size=1024, columns=[self.text_field]):
            for text in batch.column(0).to_pylist():
                yield f"{self.path.name}:{row}", text
                row += 1

    def fingerprint(self) -> str:
        return f"parquet:{self.path.resolve()}:{self.text_field}:{_file_fingerprint([self.path], self.path)}"

    def _empty_hint(self) -> str:
        return f"Every {self.text_field!r} value is empty or null."


class HFSource(Source):
    """A Hugging Face hub dataset, streamed (``datasets.load_dataset(..., streaming=True)``)."""

    def __init__(self, name: str, config: str | None = None, split: str = "train", text_field: str = "text"):
        self.name, self.config, self.split, self.text_field = name, config, split, text_field
        self.spec = f"hf:{name}:{config or ''}:{split}"

    def _iter_raw(self) -> Iterator[tuple[str, str]]:
        import datasets

        reason = hub_unreachable_reason()
        if reason is not None:
            raise ValueError(
                f"cannot stream Hugging Face dataset {self.spec!r}: {reason}. Use 'builtin' or a local "
                f".txt/.jsonl/.parquet path instead, or set HF_HUB_OFFLINE=1 to read it from the local "
                f"HF cache if it was downloaded before."
            )
        try:
            ds = datasets.load_dataset(self.name, self.config, split=self.split, streaming=True)
            it = iter(ds)
            first = next(it, None)
        except Exception as e:  # the hub raises many different types; all mean "cannot read it"
            raise ValueError(
                f"could not open Hugging Face dataset {self.spec!r}: {type(e).__name__}: {e}. "
                f"This needs network access to the hub (or a local cache with HF_HUB_OFFLINE=1); "
                f"offline, use 'builtin' or a local .txt/.jsonl/.parquet path instead."
            ) from e
        if first is None:
            return
        for i, record in enumerate(_chain_first(first, it)):
            if self.text_field not in record:
                raise ValueError(
                    f"{self.spec}: no field {self.text_field!r} (found {sorted(record)}). "
                    f"Pass text_field=<name of the text field>."
                )
            yield f"{self.name}:{self.split}:{i}", record[self.text_field]


def _chain_first(first, it):
    yield first
    yield from it


# Used by tests and callers who want the corpus text without any tokenisation.
def read_builtin_text(limit_chars: int | None = None) -> str:
    """The packaged corpus as one string (documents joined by blank lines), optionally truncated."""
    buf = io.StringIO()
    for text in BuiltinSource():
        buf.write(text)
        buf.write("\n\n")
        if limit_chars is not None and buf.tell() >= limit_chars:
            break
    out = buf.getvalue()
    return out if limit_chars is None else out[:limit_chars]
