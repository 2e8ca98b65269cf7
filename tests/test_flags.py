"""The shared flags are defined once (`fusedkv.flags`) and byte sizes read by one unit rule (`fusedkv.argtypes`)."""

import argparse
import ast
from pathlib import Path

import pytest

from fusedkv import argtypes, flags
from fusedkv.config_fields import FUSION_INITS
from fusedkv.train.memory_estimate import parse_bytes as memory_bytes

PACKAGE = Path(__file__).resolve().parents[1] / "fusedkv"
SHARED = {"--device", "--dtype", "--seed", "--fusion-init"}
# Definitions not yet moved to fusedkv.flags, each with its reason.
NOT_YET_SHARED = {
    ("fusedkv/serving/command.py", "--dtype"),  # vLLM's own dtype words ("auto" = the checkpoint's)
    ("fusedkv/serving/offline.py", "--dtype"),
}


def _definitions():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument" and node.args
                    and isinstance(node.args[0], ast.Constant) and node.args[0].value in SHARED):
                yield rel, node.args[0].value


def test_shared_flags_are_defined_once():
    found = set(_definitions())
    outside = {d for d in found if d[0] != "fusedkv/flags.py"} - NOT_YET_SHARED
    assert not outside, f"define these with fusedkv.flags' add_*_flag: {sorted(outside)}"
    assert NOT_YET_SHARED <= found, f"moved already (drop from NOT_YET_SHARED): {sorted(NOT_YET_SHARED - found)}"
    assert {flag for rel, flag in found if rel == "fusedkv/flags.py"} == SHARED


def _parse(add, *argv, **kw):
    p = argtypes.Parser(prog="t")
    add(p, **kw)
    return p.parse_args(list(argv))


def test_shared_flags_parse_and_refuse():
    assert _parse(flags.add_device_flag, "--device", "cuda:1").device == "cuda:1"
    assert _parse(flags.add_device_flag).device == "cpu"
    assert _parse(flags.add_device_flag, default=None, indexed=False).device is None
    assert _parse(flags.add_seed_flag, "--seed", "7").seed == 7
    assert _parse(flags.add_fusion_init_flag).fusion_init == "equivalent"
    assert _parse(flags.add_dtype_flag, "--dtype", "bfloat16", default="float32").dtype == "bfloat16"
    for add, argv, kw in ((flags.add_device_flag, ("--device", "gpu"), {}),
                          (flags.add_device_flag, ("--device", "cuda:1"), dict(default=None, indexed=False)),
                          (flags.add_seed_flag, ("--seed", "-1"), {}),
                          (flags.add_fusion_init_flag, ("--fusion-init", "zeros"), {}),
                          (flags.add_dtype_flag, ("--dtype", "int8"), dict(default="float32"))):
        with pytest.raises(SystemExit) as e:
            _parse(add, *argv, **kw)
        assert e.value.code == 2
    assert set(FUSION_INITS) <= set(_choices(flags.add_fusion_init_flag))


def _choices(add):
    p = argparse.ArgumentParser()
    add(p)
    return p._actions[-1].choices


@pytest.mark.parametrize("text, value", [("80G", 80e9), ("80GB", 80e9), ("80 gb", 80e9), ("80GiB", 80 * 2**30),
                                         ("512M", 512e6), ("512MiB", 512 * 2**20), ("141e9", 141e9), ("1k", 1e3)])
def test_one_unit_rule_for_byte_sizes(text, value):
    assert argtypes.parse_bytes(text) == int(value)
    assert memory_bytes(text) == int(value)  # the memory planner reads sizes by the same rule
    assert argtypes.byte_size()(text) == int(value)


@pytest.mark.parametrize("text", ["", "80X", "-1G", "0", "G", "nan"])
def test_bad_byte_sizes_are_refused(text):
    with pytest.raises(ValueError):
        argtypes.parse_bytes(text)
    with pytest.raises(argparse.ArgumentTypeError):
        argtypes.byte_size()(text)
    with pytest.raises(argparse.ArgumentTypeError, match="under 1,048,576 bytes"):
        argtypes.byte_size(2**20)("1k")
