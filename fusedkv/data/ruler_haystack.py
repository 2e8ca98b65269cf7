"""The text RULER-style prompts are made of, and how a prompt is sized (`fusedkv.data.ruler_tasks` builds the tasks):
the repeated noise sentences and the essay haystack (the packaged KJV prose), needles inserted at depths, and the
largest haystack whose prompt fits a token budget (`largest_fitting`, also used by the retrieval data).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import lru_cache

from ._ruler_words import ADJECTIVES, NOUNS, VERBS
from .sources import iter_kjv_books

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
REAL_WORDS = frozenset(ADJECTIVES) | frozenset(NOUNS) | frozenset(VERBS)  # English words, before pseudo-words


def insert_at(units: list[str], items: list[tuple[float, str]]) -> list[str]:
    """Insert each (fraction, text) before unit ``round(fraction * len(units))``; ties keep their order."""
    at: dict[int, list[str]] = {}
    for frac, text in sorted(items, key=lambda x: x[0]):  # sorted() is stable
        at.setdefault(min(len(units), max(0, round(frac * len(units)))), []).append(text)
    out: list[str] = []
    for i in range(len(units) + 1):
        out.extend(at.get(i, ()))
        if i < len(units):
            out.append(units[i])
    return out


def largest_fitting(build: Callable[[int], str], count: Callable[[str], int], limit: int, n_min: int,
                     n_max: int, hint: int | None) -> tuple[int, str, int]:
    """Largest n in [n_min, n_max] whose ``build(n)`` has at most ``limit`` tokens.

    Gallops from ``hint`` (the previous sample's answer) and then bisects, so a sample typically costs a
    handful of tokenizations. Token count is only nearly monotone in n; only verified n are returned.
    """
    memo: dict[int, tuple[bool, str, int]] = {}

    def fits(n: int) -> bool:
        if n not in memo:
            text = build(n)
            c = count(text)
            memo[n] = (c <= limit, text, c)
        return memo[n][0]

    if not fits(n_min):
        raise ValueError(f"length {limit} tokens is too short for this task's template "
                         f"(the smallest prompt has {memo[n_min][2]} tokens)")
    lo, hi = n_min, None
    if hint is not None and n_min < hint <= n_max:
        step = max(1, hint // 64)
        if fits(hint):
            lo = hint
        else:
            hi = hint
            while hi - step > lo:
                if fits(hi - step):
                    lo = hi - step
                    break
                hi, step = hi - step, step * 2
    if hi is None:
        step = max(1, lo // 64)
        while True:
            probe = min(lo + step, n_max)
            if probe == lo:
                return lo, memo[lo][1], memo[lo][2]
            if fits(probe):
                lo, step = probe, step * 2
            else:
                hi = probe
                break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, memo[lo][1], memo[lo][2]


_NOISE_SENTS = NOISE.replace(". ", ".\0").split("\0")


def repeat_context(n: int, items: list[tuple[float, str]]) -> str:
    """RULER's repeated-noise haystack with needles, counted in noise *sentences* (n of them).

    RULER repeats the five-sentence noise line and inserts needles between lines; counting sentences
    instead gives five times finer needle depths in short prompts. The layout stays one noise line per
    repetition, with each needle on its own line.
    """
    out = insert_at([_NOISE_SENTS[j % len(_NOISE_SENTS)] for j in range(n)], [(f, "\x01" + t) for f, t in items])
    parts = []
    for k, u in enumerate(out):
        nxt = out[k + 1] if k + 1 < len(out) else None
        newline = u.startswith("\x01") or u == _NOISE_SENTS[-1] or (nxt is not None and nxt.startswith("\x01"))
        parts.append(u.lstrip("\x01") + ("" if nxt is None else "\n" if newline else " "))
    return "".join(parts)


def sentences(words: list[str]) -> list[str]:
    """Split text into sentences; over-long ones are cut at 40 words so depth stays fine-grained."""
    out = []
    for sent in re.split(r"(?<=[.!?])\s+", " ".join(words)):
        w = sent.split()
        out.extend(" ".join(w[i : i + 40]) for i in range(0, len(w), 40))
    return out


@lru_cache(maxsize=4)
def essay_words(text: str | None) -> tuple[str, ...]:
    if text is None:
        text = default_haystack_text()
    words = text.split()
    if len(words) < 50:
        raise ValueError("haystack text is too short (need at least 50 words)")
    return tuple(words)


def default_haystack_text() -> str:
    """The King James prose of the packaged public-domain corpus (it reads more like RULER's essays than the
    plays), cleaned of verse numbers."""
    text = "\n".join(t for _, t in iter_kjv_books())
    # Drop chapter headings ("Genesis 3") and verse numbers: stray small numbers would look like
    # (wrong) needle values to the model.
    text = re.sub(r"^\s*\d+ ", "", text, flags=re.M)
    text = re.sub(r"^\s*(?:\d )?[A-Z][A-Za-z ]+ \d+\s*$", "", text, flags=re.M)
    return text
