"""Settings as their fields' types: YAML files and `--set key=value` give strings, numbers and lists, and
`coerce` turns each into what the TrainConfig or FusedKVConfig annotation says ("2M" tokens, "1e-3", "yes",
"null", "[0.9, 0.95]" as a tuple), or raises a ValueError naming the field. The types themselves come from
the dataclasses (`typing.get_type_hints(TrainConfig)`, `fusedkv.config.field_types()`)."""

from __future__ import annotations

import math
import types
import typing
from pathlib import Path

from huggingface_hub.dataclasses import type_validator

_SUFFIX = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12,
           "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}  # binary: a batch of 2^k tokens is whole sequences
_BOOLS = {"true": True, "yes": True, "1": True, "on": True, "false": False, "no": False, "0": False, "off": False}


def coerce(name: str, hint, value):
    """`value` read as the annotated type `hint` (`_read`), then checked against it by `@strict`'s own type
    validator (huggingface_hub.dataclasses, as `fusedkv.config` does); ValueError naming the field otherwise."""
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and _fits(None, None, hint)):
        if _fits(None, None, hint):
            return None
        raise ValueError(f"{name}: must not be None")
    read = _read(hint, value)
    if not _fits(name, read, hint):
        text = str(hint) if typing.get_args(hint) else hint.__name__
        raise ValueError(f"{name}={value!r}: expected {text.replace(' | ', ' or ')}")
    return read


def _fits(name, value, hint) -> bool:
    try:
        type_validator(name or "value", value, hint)
    except TypeError:
        return False
    return True


def _read(hint, value):
    """`value` as `hint` where a YAML / `--set` value can say it ("2M", "1e6" and 4.0 as int; "1e-3" as float;
    "yes" as bool; a list or "0.9,0.95" as a tuple); anything else unchanged, for the validator to judge."""
    if isinstance(hint, types.UnionType):  # the first member the value can be read as
        members = [t for t in typing.get_args(hint) if t is not type(None)]
        return next((r for r, t in ((_read(t, value), t) for t in members) if _fits(None, r, t)), value)
    origin, args = typing.get_origin(hint) or hint, typing.get_args(hint)
    if hint is bool and isinstance(value, str):
        return _BOOLS.get(value.lower(), value)
    if hint is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if hint is int and isinstance(value, str):
        s = value.strip().lower().replace("_", "")
        unit = s[-2:] if s[-2:] in _SUFFIX else s[-1:]
        mult = _SUFFIX.get(unit, 1) if s else 1
        try:
            num = float(s[: -len(unit)] if mult != 1 else s) * mult  # "2M" tokens, "1e6", "200b", "1Mi"
        except ValueError:
            return value
        return int(num) if math.isfinite(num) and num.is_integer() else value
    if hint is float and isinstance(value, int | str) and not isinstance(value, bool):
        try:
            return float(value)
        except ValueError:
            return value
    if hint is str and isinstance(value, Path):
        return str(value)
    if origin is list and args and isinstance(value, list | tuple):
        return [_read(args[0], v) for v in value]
    if origin is tuple and isinstance(value, str | list | tuple):
        items = [v for v in value.strip("()[] ").split(",") if v.strip()] if isinstance(value, str) else value
        return tuple(_read(t, v) for t, v in zip(args, items)) if len(items) == len(args) else value
    return value
