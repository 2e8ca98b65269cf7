"""Where a source model comes from: a Hugging Face checkpoint directory, or a GGUF file.

`open_source(path)` turns either into the checkpoint directory that `convert` (and `uptrain`, `serve`)
read. A GGUF file goes through transformers' own GGUF loader (the `gguf` package, the `gguf` extra):
`from_pretrained(dir, gguf_file=NAME, dtype=float32)` dequantises every tensor to float32, the tokenizer
and the chat template come from the file too, and the result is saved as an ordinary float32 checkpoint
(the loader's `quantization_config` cleared: the saved weights are plain floats). The model is freed before
the caller reads the directory, so a big model is never held twice for longer than transformers' own load.
"""

from __future__ import annotations

import contextlib
import gc
import json
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from ..errors import UsageError

FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
# transformers' model type for a GGUF architecture where the two names differ (its loader renames them)
_GGUF_MODEL_TYPES = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}


def is_gguf(path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def supported_gguf_architectures() -> list[str]:
    """The GGUF architectures transformers reads that `convert` imports (the installed transformers decides)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    from .families import MODEL_TYPES

    return [a for a in GGUF_CONFIG_MAPPING if _GGUF_MODEL_TYPES.get(a, a) in MODEL_TYPES]


def _gguf_reader(path: Path):
    try:
        import gguf
    except ImportError as e:
        raise UsageError(f"{path} is a GGUF file; reading it needs the gguf package: "
                         "pip install 'fusedkv[gguf]'") from e
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"{path} is not a readable GGUF file ({first}); download it again") from e


def gguf_summary(path) -> tuple[str, Counter]:
    """(the file's general.architecture, how many tensors of each GGML type it holds), from its header."""
    reader = _gguf_reader(Path(path))
    field = reader.fields.get("general.architecture")
    arch = str(field.contents()) if field is not None else "?"
    return arch, Counter(t.tensor_type.name for t in reader.tensors)


def dequantisation_line(name: str, types: Counter) -> str:
    """One line naming the source's tensor types, e.g. 'dequantised Q4_1 x210, Q8_0 x1 (and F32 x61) to float32'."""
    quantised = [f"{t} x{n}" for t, n in types.most_common() if t not in FLOAT_TYPES]
    floats = [f"{t} x{n}" for t, n in types.most_common() if t in FLOAT_TYPES]
    if not quantised:
        return f"{name}: read {', '.join(floats)} tensors as float32 (nothing quantised)"
    rest = f" (and {', '.join(floats)})" if floats else ""
    return f"{name}: dequantised {', '.join(quantised)}{rest} to float32"


def check_gguf_architecture(path: Path, arch: str) -> None:
    supported = supported_gguf_architectures()
    if _GGUF_MODEL_TYPES.get(arch, arch) not in [_GGUF_MODEL_TYPES.get(a, a) for a in supported]:
        raise UsageError(f"{path.name} is a GGUF {arch!r} model; fusedkv imports GGUF architectures "
                         f"{', '.join(supported)} (those transformers reads and convert supports)")


def write_gguf_checkpoint(path, out, say=print) -> Path:
    """Import the GGUF file `path` into the (new or empty) directory `out` as a float32 transformers checkpoint
    with its tokenizer, chat template and generation config; returns `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, out = Path(path), Path(out)
    if not path.is_file():
        raise UsageError(f"{path} does not exist; pass a .gguf file or a Hugging Face checkpoint directory")
    arch, types = gguf_summary(path)
    check_gguf_architecture(path, arch)
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, KeyError, OSError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"transformers could not load {path.name} ({first})") from e
    # The loader's quantizer marks the model "not serialisable"; its weights are already float32.
    model.hf_quantizer = None
    model.config.quantization_config = None
    del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    gc.collect()
    _drop_null_quantization(out / "config.json")
    say(dequantisation_line(path.name, types))
    return out


def _drop_null_quantization(cfg_file: Path) -> None:
    cfg = json.loads(cfg_file.read_text())
    if "quantization_config" in cfg:
        cfg.pop("quantization_config")
        cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def open_source(path, workdir=None, say=print, prefix: str = "fusedkv-gguf-") -> Iterator[Path]:
    """The checkpoint directory for a source path: a directory as it is; a `.gguf` file imported (see the
    module docstring) into a temporary directory `prefix*` in `workdir` (default: the system's), removed on exit."""
    path = Path(path)
    if not is_gguf(path):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix=prefix, dir=workdir) as tmp:
        yield write_gguf_checkpoint(path, Path(tmp) / "checkpoint", say)


def source_directory(path, keep_in, say=print) -> Path:
    """A lasting checkpoint directory for a source path, for commands that read it again later (uptrain's
    teacher, a resumed run): a directory as it is; a `.gguf` file imported once into `keep_in` and reused
    while that import is complete and came from the same file (name, size and modification time)."""
    from ..model_dirs import write_directory_atomically

    path, keep_in = Path(path), Path(keep_in)
    if not is_gguf(path):
        return path
    if not path.is_file():
        raise UsageError(f"{path} does not exist; pass a .gguf file or a Hugging Face checkpoint directory")
    stamp = {"gguf": str(path.resolve()), "bytes": path.stat().st_size, "mtime_ns": path.stat().st_mtime_ns}
    marker = keep_in / "fusedkv_gguf_source.json"
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return keep_in

    def write(out: Path) -> None:
        write_gguf_checkpoint(path, out, say)
        (out / marker.name).write_text(json.dumps(stamp) + "\n")

    write_directory_atomically(keep_in, write, overwrite=True)
    return keep_in
