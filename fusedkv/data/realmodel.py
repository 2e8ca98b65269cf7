"""Text for uptraining a real pretrained model, and the held-out texts it is scored on; all of it offline.

The built-in corpus (Shakespeare + KJV) suits the small models trained here from scratch; a pretrained
model uptrained on it learns to read its new K/V for early-modern English only. These sources come with
the Python that runs fusedkv (PSF licence), so they need no download:

* ``stdlib`` (training): every ``.py`` file of the standard library (code, docstrings and comments:
  modern technical English and Python) except the held-out parts below and the test suites
  (``test/``, ``idlelib/idle_test``, ``lib2to3/tests``, ``tkinter/test``) and installed packages. Any
  file sharing more than `MAX_SHARED` of its long lines with a held-out text is dropped, too. One
  document per file; the validation split is a hash-chosen 2% of the files (`prepare_dataset`'s default).
* ``heldout:prose``: the Python language reference prose that pydoc shows (``pydoc_data.topics``), one
  document per topic; ``heldout:code``: the ``email`` package's top-level modules (``email/*.py``, of the
  system Python where there is one, `HELDOUT_EMAIL`);
  ``heldout:builtin``: the built-in corpus's held-out works. A held-out spec prepares into a dataset whose
  validation split is the whole text (``fusedkv eval CKPT --val <prepared dir>``); `write_heldout` also
  writes them as plain files for ``fusedkv eval --text``.

    python -m fusedkv.data.realmodel DIR     # DIR/{prose,code,builtin}.txt and the size of each source
"""

from __future__ import annotations

import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from ..utils import write_text_atomic
from .sources import BUILTIN_VAL_DOCS, BuiltinSource, Source, _file_fingerprint, read_text_file

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# The held-out code is the system Python's email package where there is one (the project's evaluation texts
# were fixed on it: /usr/lib/python3.11/email), else this interpreter's; the training text excludes both.
_SYSTEM_EMAIL = Path(f"/usr/lib/python{sys.version_info.major}.{sys.version_info.minor}/email")
HELDOUT_EMAIL = _SYSTEM_EMAIL if _SYSTEM_EMAIL.is_dir() else STDLIB / "email"
HELDOUT_KINDS = ("prose", "code", "builtin")
# Never trained on: the held-out texts, the test suites, and what pip installed.
EXCLUDED_DIRS = ("email", "pydoc_data", "test", "idlelib/idle_test", "lib2to3/tests", "tkinter/test",
                 "site-packages", "dist-packages", "__pycache__")
# A line this long (stripped) is specific enough that sharing it means sharing text, not an idiom.
LONG_LINE = 40
MAX_SHARED = 0.02


def iter_heldout(kind: str) -> Iterator[tuple[str, str]]:
    """(name, text) of the held-out documents of one kind (module docstring)."""
    if kind == "prose":
        from pydoc_data.topics import topics

        for name in sorted(topics):
            yield f"pydoc/{name}", topics[name]
    elif kind == "code":
        for path in sorted(HELDOUT_EMAIL.glob("*.py")):
            yield f"email/{path.name}", read_text_file(path)
    elif kind == "builtin":
        held = set(BUILTIN_VAL_DOCS)
        yield from ((n, t) for n, t in BuiltinSource().iter_named() if n in held)
    else:
        raise ValueError(f"heldout:{kind}: unknown held-out text; choose one of "
                         f"{', '.join('heldout:' + k for k in HELDOUT_KINDS)}")


def _long_lines(text: str) -> set[str]:
    return {s for s in (line.strip() for line in text.splitlines()) if len(s) >= LONG_LINE}


def stdlib_files() -> list[Path]:
    out = []
    for path in sorted(STDLIB.rglob("*.py")):
        rel = path.relative_to(STDLIB).as_posix()
        if not any(rel == d or rel.startswith(d + "/") or f"/{d}/" in f"/{rel}" for d in EXCLUDED_DIRS):
            out.append(path)
    return out


class StdlibSource(Source):
    """``stdlib``: the standard library's source, minus the held-out texts (module docstring)."""

    spec = "stdlib"

    def _iter_raw(self) -> Iterator[tuple[str, str]]:
        held = set().union(*(_long_lines(t) for k in ("prose", "code") for _, t in iter_heldout(k)))
        self.dropped = []
        for path in stdlib_files():
            text = read_text_file(path)
            lines = _long_lines(text)
            if lines and len(lines & held) > MAX_SHARED * len(lines):
                self.dropped.append(path.relative_to(STDLIB).as_posix())
                continue
            yield f"stdlib/{path.relative_to(STDLIB).as_posix()}", text

    def fingerprint(self) -> str:
        files = stdlib_files()
        return f"stdlib:{sys.version_info.major}.{sys.version_info.minor}:" + _file_fingerprint(files, STDLIB)

    def _empty_hint(self) -> str:
        return f"No Python source found under {STDLIB}; this Python ships without its standard library source."


class HeldoutSource(Source):
    """``heldout:KIND``: a held-out text whose every document is validation (`eval_only`)."""

    eval_only = True

    def __init__(self, kind: str):
        self.kind, self.spec = kind, f"heldout:{kind}"
        self.val_docs = tuple(name for name, _ in iter_heldout(kind))  # also checks the kind

    def _iter_raw(self) -> Iterator[tuple[str, str]]:
        yield from iter_heldout(self.kind)

    def fingerprint(self) -> str:
        if self.kind == "code":
            return self.spec + ":" + _file_fingerprint(sorted(HELDOUT_EMAIL.glob("*.py")), HELDOUT_EMAIL)
        return self.spec + (f":{sys.version_info.major}.{sys.version_info.minor}" if self.kind == "prose" else "")


def write_heldout(out_dir) -> dict[str, Path]:
    """The held-out texts as one UTF-8 file each (documents separated by a blank line)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for kind in HELDOUT_KINDS:
        paths[kind] = out / f"{kind}.txt"
        write_text_atomic(paths[kind], "\n\n".join(t for _, t in iter_heldout(kind)))
    return paths


def main(argv=None) -> int:
    out = Path((argv or sys.argv[1:] or ["heldout"])[0])
    for kind, path in write_heldout(out).items():
        print(f"heldout:{kind}: {path} ({path.stat().st_size:,} bytes)")
    src = StdlibSource()
    docs = list(src.iter_named())
    print(f"stdlib: {len(docs)} files, {sum(len(t) for _, t in docs):,} characters from {STDLIB}; dropped for "
          f"overlap with the held-out texts: {', '.join(src.dropped) or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
