"""Checks that turn a bad checkpoint directory into a clear message before transformers reads it,
and the integrity manifest that training checkpoints and trained models (`RUN/final/`) carry.

transformers would warn and carry on when a `qwen3` config is loaded into a FusedKV model, and fail
deep inside safetensors on a truncated file. Users get told what is wrong and how to fix it instead.

Manifest: `manifest.json` lists the size and SHA-256 of every file of the directory; it is written
last (atomically) by `write_manifest`, and `check_checkpoint_dir` (which `from_pretrained` calls)
verifies it, so flipped bytes inside `model.safetensors` are refused instead of producing NaN. A
model directory without a manifest (`save_pretrained` by a user, `fusedkv convert`) still loads. Files
are hashed once per process (streamed in 4 MiB blocks) while their size and modification time stay.

Writing a model (`fusedkv convert`, `fusedkv prune`, any command that makes a model directory) goes
through `check_destination` (before any work: never a file, never the source, never a directory that
already holds files unless `overwrite`) and `write_directory_atomically` (a temporary directory beside
the destination, renamed into place once complete), so no command loses a model. The writer holds an OS
lock (`fcntl.flock`) on `<temporary>.lock` while it works; the kernel drops it however the writer ends, so
the next write to the same destination removes the temporaries of writers that were killed (kill -9, power
loss) and leaves those of live ones alone.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from .errors import RunError, UsageError
from .utils import replace_dir

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_BLOCK = 1 << 22
# (path, device, inode, size, mtime_ns) -> SHA-256: a file is hashed once per process.
_HASHED: dict[tuple, str] = {}


def sha256_file(path: str | Path) -> str:
    """SHA-256 of a file, streamed; remembered while the file's size and mtime are unchanged."""
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _HASHED:
        h = hashlib.sha256()
        with path.open("rb") as f:
            while block := f.read(_BLOCK):
                h.update(block)
        _HASHED[key] = h.hexdigest()
    return _HASHED[key]


def _fsync(path: Path) -> None:
    with path.open("rb+") as f:
        os.fsync(f.fileno())


def write_manifest(directory: str | Path, names=None, **fields) -> dict:
    """fsync every file of `directory` (or `names`), then write `manifest.json` with their sizes and
    SHA-256 atomically (temp file, fsync, rename). `fields` (e.g. step=) are stored alongside."""
    directory = Path(directory)
    if names is None:
        names = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)
    manifest = {"format": MANIFEST_FORMAT, **fields, "files": {}}
    for name in names:
        path = directory / name
        _fsync(path)
        manifest["files"][name] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    tmp = directory / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    _fsync(tmp)
    os.replace(tmp, directory / MANIFEST)
    return manifest


def read_manifest(directory: str | Path) -> dict | None:
    """The manifest of `directory`, or None when it has none; ValueError when it is unreadable."""
    mpath = Path(directory) / MANIFEST
    if not mpath.is_file():
        return None
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
        if not isinstance(files, dict) or not all("bytes" in v and "sha256" in v for v in files.values()):
            raise TypeError("'files' must map names to their bytes and sha256")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{directory} is corrupt: unreadable {MANIFEST} ({e})") from e
    return manifest


def verify_manifest(directory: str | Path, what: str | None = None) -> dict | None:
    """Check every file the manifest lists (present, same size, same SHA-256); ValueError naming the
    file otherwise. Returns the manifest (None when the directory has none)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest is None:
        return None
    what = what or str(directory)
    for name, info in manifest["files"].items():
        f = directory / name
        if not f.is_file():
            raise ValueError(f"{what} is corrupt: {name} is missing")
        size = f.stat().st_size
        if size != info["bytes"]:
            raise ValueError(
                f"{what} is corrupt: {name} has {size} bytes, the manifest says {info['bytes']} (truncated or "
                "overwritten)"
            )
        if sha256_file(f) != info["sha256"]:
            raise ValueError(
                f"{what} is corrupt: {name} does not match its SHA-256 in {MANIFEST} (damaged bytes); "
                f"restore it from a copy or a training checkpoint (if you changed it on purpose, delete {MANIFEST})"
            )
    return manifest


def check_checkpoint_dir(path, config=None, model_types: tuple[str, ...] = ("fusedkv",)) -> None:
    """Validate a local checkpoint directory (hub names pass through untouched) holding one of `model_types`."""
    p = Path(str(path))
    if not p.exists():
        if os.sep in str(path) or str(path).startswith("."):
            raise ValueError(f"checkpoint directory {str(path)!r} does not exist")
        return  # a hub repo id: let transformers resolve it
    if not p.is_dir():
        raise ValueError(f"{str(path)!r} is a file; pass the checkpoint directory (the one with config.json)")
    if config is None:
        cfg_file = p / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"{p} has no config.json; it is not a saved model directory (save with save_pretrained)")
        try:
            model_type = json.loads(cfg_file.read_text()).get("model_type")
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_file} is not valid JSON ({e}); the checkpoint is corrupt") from e
        if model_type not in model_types:
            hint = ""
            if "fusedkv" in model_types and model_type is not None:  # a Hugging Face checkpoint: import it first
                hint = (f"; import it first with `fusedkv convert {p} OUT_DIR --plan PLAN` (vanilla keeps its "
                        "full cache; `fusedkv convert --help` lists the families it reads)")
            wanted = " or ".join(repr(t) for t in model_types)
            raise ValueError(f"{p} holds a {model_type!r} model, not a {wanted} model{hint}")
    weights = sorted(p.glob("*.safetensors"))
    if not weights and not (p / "pytorch_model.bin").exists():
        raise ValueError(f"{p} has no weights (*.safetensors); the save did not finish or the files were removed")
    verify_manifest(p)  # trained models (RUN/final) carry one; others pass
    for w in weights:
        _check_safetensors(w)
    for w in weights:
        check_finite_safetensors(w)


# (path, device, inode, size, mtime_ns) of safetensors files whose tensors were found finite.
_FINITE: set[tuple] = set()


def _non_finite(name: str, tensor) -> str | None:
    """"NAME (N of M values NaN or inf)" when a floating tensor holds a non-finite value, else None."""
    import torch

    if not tensor.is_floating_point():
        return None
    bad = sum(int((~torch.isfinite(part)).sum()) for part in tensor.detach().reshape(-1).split(1 << 24))
    return f"{name} ({bad} of {tensor.numel()} values NaN or inf)" if bad else None


def _refuse_non_finite(what: str, found: list[str]) -> None:
    if found:
        more = f" and {len(found) - 1} more tensor(s)" if len(found) > 1 else ""
        raise ValueError(f"{what} holds non-finite weights: {found[0]}{more}; the checkpoint is corrupt or its "
                         "training diverged, so every result would be NaN. Use an intact copy or an earlier "
                         "checkpoint")


def check_finite_safetensors(file: str | Path) -> None:
    """ValueError naming the tensor when a safetensors file holds a NaN or inf weight: such a model computes
    NaN everywhere, so every command refuses it at load, before any work (once per file per process)."""
    from safetensors import safe_open

    file = Path(file)
    st = file.stat()
    key = (str(file.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key in _FINITE:
        return
    found = []
    with safe_open(str(file), framework="pt") as f:
        for name in f.keys():
            bad = _non_finite(name, f.get_tensor(name))
            if bad:
                found.append(bad)
    _refuse_non_finite(str(file), found)
    _FINITE.add(key)


def check_finite_model(model, what: str) -> None:
    """The same check on a model in memory (e.g. one just converted, before it is written)."""
    found = [bad for name, t in model.state_dict().items() if (bad := _non_finite(name, t))]
    _refuse_non_finite(what, found)


def _check_safetensors(file: Path) -> None:
    """A safetensors file starts with an 8-byte header length, then a JSON header whose offsets must
    fit in the file: checking that catches truncation without reading the tensors."""
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{file} is truncated ({size} bytes); re-save or re-download the checkpoint")
        n = int.from_bytes(head, "little")
        if n <= 0 or 8 + n > size:
            raise ValueError(f"{file} is corrupt: its header does not fit in the file; re-save the checkpoint")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{file} is corrupt: unreadable header ({e})") from e
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        raise ValueError(
            f"{file} is truncated or corrupt: its header describes {8 + n + end} bytes but the file has {size}; "
            "re-save the checkpoint"
        )


def check_destination(dst: str | Path, overwrite: bool, source: str | Path | None = None,
                      what: str = "destination") -> None:
    """Refuse, before any work, a model destination that would lose data: a file, the source itself (or a
    folder holding it), or a directory that already holds files (another model) without `overwrite`."""
    dst = Path(dst)
    if dst.exists() and not dst.is_dir():
        raise UsageError(f"{what} {dst} is a file; give a directory to write the model to")
    if source is not None and Path(source).exists():
        src = Path(source).resolve()
        if dst.resolve() == src or dst.resolve() in src.parents:
            raise UsageError(f"{what} {dst} would replace the source {source}; choose another directory")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        held = " (a model)" if (dst / "config.json").exists() else ""
        raise UsageError(f"{what} {dst} already holds files{held}; pass --overwrite (overwrite=True) to replace "
                         "them, or choose a new directory")


def _temporary_prefix(dst: Path) -> str:
    return f".{dst.name}.tmp-"


def remove_dead_temporaries(dst: str | Path) -> list[Path]:
    """Remove the temporary directories beside `dst` whose writer is gone (its lock file can be locked);
    returns them. A live writer holds its lock, so its temporary directory stays."""
    dst = Path(dst)
    removed = []
    if not dst.parent.is_dir():
        return removed
    for lock_path in sorted(dst.parent.glob(f"{_temporary_prefix(dst)}*.lock")):
        try:
            f = open(lock_path, "a")  # noqa: SIM115 (closed below)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its writer is alive
            tmp = lock_path.with_name(lock_path.name[: -len(".lock")])
            shutil.rmtree(tmp, ignore_errors=True)
            lock_path.unlink(missing_ok=True)
            removed.append(tmp)
        finally:
            f.close()
    return removed


def write_directory_atomically(dst: str | Path, write, overwrite: bool = True) -> None:
    """`write(tmp)` fills a temporary directory beside `dst` (same file system), which then replaces `dst`
    by rename; on any failure the temporary directory is removed and `dst` is untouched. Without
    `overwrite`, a `dst` that gained files while the model was being made is refused, not replaced. The
    temporaries of killed writers of `dst` are removed first (module docstring)."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temporaries(dst)
    fd, lock_name = tempfile.mkstemp(prefix=_temporary_prefix(dst), suffix=".lock", dir=dst.parent)
    fcntl.flock(fd, fcntl.LOCK_EX)  # held until this process ends or finishes below
    tmp = Path(lock_name[: -len(".lock")])
    try:
        tmp.mkdir()
    except BaseException:
        os.close(fd)
        Path(lock_name).unlink(missing_ok=True)
        raise
    try:
        try:
            write(tmp)
        except Exception as e:
            if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e):
                raise RunError(f"no space left on the device while writing {dst}; nothing was changed there, "
                               "free some disk space and retry") from e
            raise
        check_destination(dst, overwrite)
        replace_dir(tmp, dst)  # the old directory is deleted only once the new one is in place
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        Path(lock_name).unlink(missing_ok=True)
        os.close(fd)
