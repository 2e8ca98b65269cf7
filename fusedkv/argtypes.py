"""Argument types for the `fusedkv` command line: every numeric flag is range-checked while parsing.

`Parser` is the argparse parser every `fusedkv` command uses (a bad flag is one line on stderr, exit 2) and
`add_debug_flag` the one `--debug` flag; both also serve stand-alone entry points such as
`python -m fusedkv.train.command`, which sit below `fusedkv.cli` and cannot import it.

Each factory returns a function for argparse's `type=`; a bad value raises `argparse.ArgumentTypeError`,
which argparse reports as "argument --flag: <why>" with exit code 2 before any work starts. Integers
are capped at 2**31 - 1 so that a huge value is refused here instead of overflowing a tensor shape, and
floats must be finite (`float("nan")` parses, and would otherwise slip through every comparison).

Byte sizes have one unit rule, IEC 80000-13's (`parse_bytes`): k, M, G, T (with or without B) are powers of
1000 and KiB, MiB, GiB, TiB powers of 1024, so "80G" and "80GB" are 80e9 bytes and "80GiB" 80 * 2**30.
"""

from __future__ import annotations

import argparse
import math
import re
import sys

INT_MAX = 2**31 - 1
EXIT_USAGE = 2  # fusedkv.errors.EXIT_USAGE, as argparse itself uses

DEBUG_HELP = "on an error, show the full traceback instead of one line (also: FUSEDKV_DEBUG=1)"


class Parser(argparse.ArgumentParser):
    """argparse, with a bad flag reported in one line (usage is one `--help` away)."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def add_debug_flag(parser: argparse.ArgumentParser, default=False) -> None:
    """`--debug`; a subcommand passes default=argparse.SUPPRESS so that it keeps the global flag's value."""
    parser.add_argument("--debug", action="store_true", default=default, help=DEBUG_HELP)


def _parse_int(text: str) -> int:
    try:
        return int(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _parse_float(text: str) -> float:
    try:
        value = float(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def int_range(lo: int = 1, hi: int = INT_MAX):
    """An integer in [lo, hi]."""

    def parse(text: str) -> int:
        value = _parse_int(text)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(_out_of_range(value, lo, hi))
        return value

    parse.__name__ = f"integer in [{lo}, {hi}]"
    return parse


def float_range(lo: float = 0.0, hi: float = math.inf, lo_open: bool = False, hi_open: bool = False):
    """A finite float in the interval from lo to hi (either end open on request)."""

    def parse(text: str) -> float:
        value = _parse_float(text)
        if value < lo or value > hi or (lo_open and value == lo) or (hi_open and value == hi):
            left, right = "(" if lo_open else "[", ")" if hi_open else "]"
            raise argparse.ArgumentTypeError(f"must be in {left}{lo:g}, {hi:g}{right}, got {value:g}")
        return value

    parse.__name__ = "number"
    return parse


def int_list(lo: int = 1, hi: int = INT_MAX):
    """A comma-separated, non-empty list of integers in [lo, hi], e.g. "256,1024"."""
    item = int_range(lo, hi)

    def parse(text: str) -> list[int]:
        parts = [p for p in str(text).split(",") if p.strip()]
        if not parts:
            raise argparse.ArgumentTypeError("expected a comma-separated list of integers, got nothing")
        return [item(p) for p in parts]

    parse.__name__ = "list of integers"
    return parse


def name_list(choices: tuple[str, ...] | None = None):
    """A comma-separated, non-empty list of names, each one of `choices` when given."""

    def parse(text: str) -> list[str]:
        names = [p.strip() for p in str(text).split(",") if p.strip()]
        if not names:
            raise argparse.ArgumentTypeError("expected a comma-separated list of names, got nothing")
        unknown = [n for n in names if choices is not None and n not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choose from {', '.join(choices)}")
        return names

    parse.__name__ = "list of names"
    return parse


_BYTE_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'80G' or '80GB' -> 80e9, '80GiB' -> 80 * 2**30, '141e9' -> 141e9 (the module's one unit rule); a bad or
    non-positive size raises ValueError."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _BYTE_UNITS:
        raise ValueError(f"size {text!r}: expected a number with an optional unit, e.g. 80G, 80GB or 80GiB")
    try:
        value = float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()]
    except ValueError:
        raise ValueError(f"size {text!r}: {m.group(1)!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"size {text!r}: must be positive")
    return int(value)


def byte_size(minimum: int = 1):
    """argparse type: a byte size (`parse_bytes`: G = 1e9, GiB = 2**30) of at least `minimum` bytes."""

    def parse(text: str) -> int:
        try:
            value = parse_bytes(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is under {minimum:,} bytes")
        return value

    parse.__name__ = "byte size"
    return parse


def non_empty(text: str) -> str:
    """A string that is not empty or only whitespace (paths, names)."""
    if not str(text).strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def output_file(example: str):
    """The type of a flag naming a file a command writes (a plot, a JSON report): not an existing directory
    (`example`, a file name, shows what to give instead). The command writes exactly this path, atomically
    (`fusedkv.utils.write_atomic`); tests/reliability/test_output_paths.py checks that every output flag of
    every command has this type or `output_dir`."""
    import os

    def parse(text: str) -> str:
        text = non_empty(text)
        if os.path.isdir(text):
            raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name, e.g. "
                                             f"{os.path.join(text, example)}")
        return text

    parse.fusedkv_output = "file"
    return parse


def output_dir(text: str) -> str:
    """The type of a flag naming a directory a command writes (a run, a model): not an existing file."""
    import os

    text = non_empty(text)
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a file; give a directory")
    return text


output_dir.fusedkv_output = "dir"


def _out_of_range(value: int, lo: int, hi: int) -> str:
    if hi == INT_MAX:
        return f"must be at least {lo}, got {value}" if value < lo else f"must be at most {hi:,}, got {value:,}"
    return f"must be between {lo} and {hi}, got {value}"


positive_int = int_range(1)
non_negative_int = int_range(0)
seed = int_range(0, 2**32 - 1)  # numpy's RandomState takes seeds in [0, 2**32)
positive_float = float_range(0.0, lo_open=True)
