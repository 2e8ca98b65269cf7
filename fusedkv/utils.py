"""Small helpers every part of the package needs, each written once.

Nothing here knows about models or plans: byte sizes for people, file-safe names, the one atomic file
writer (`write_atomic`, and on it JSON, text and figures: every file a command writes goes through it, so a
killed command never leaves a half-written file and a failed one never replaces a good one), an atomic
directory replace, where a model's weights live, a quick probe of the Hugging Face hub,
the processor's instruction-set flags, and the per-user cache directory.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import socket
import urllib.parse
from pathlib import Path


def human_bytes(n: float, digits: int = 1) -> str:
    """1536 -> "1.5 KiB" (binary units, `digits` decimals; whole bytes below 1 KiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    return f"{n} B"


def slug(text: str, max_len: int | None = None, lower: bool = True) -> str:
    """A filesystem-safe name: runs of other characters become "-", no leading/trailing "-." (lower case
    unless `lower=False`), at most `max_len` characters."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-.")
    name = name.lower() if lower else name
    return name[:max_len] if max_len else name


def write_atomic(path: str | Path, write) -> Path:
    """`write(tmp)` fills a temporary file beside `path` (same directory, so same file system), which then
    replaces `path` by `os.replace`: a killed process never leaves a half-written file that looks complete,
    and a write that fails leaves the old file as it was. `path` itself is written, exactly (an existing
    directory there is refused, never written beside). Returns `path`."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(21, "is a directory; give a file name", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json_atomic(path: str | Path, obj, indent: int = 1, sort_keys: bool = False, **dumps) -> Path:
    """JSON through `write_atomic` (`dumps`: more json.dumps options, e.g. default=str)."""
    return write_text_atomic(path, json.dumps(obj, indent=indent, sort_keys=sort_keys, **dumps) + "\n")


def save_figure(fig, path: str | Path, **savefig) -> Path:
    """A matplotlib figure through `write_atomic`, at exactly `path`: the format is the path's suffix (PNG
    without one; matplotlib alone would write `path.png` instead and leave `path` as it was)."""
    fmt = Path(path).suffix.lstrip(".").lower() or "png"
    return write_atomic(path, lambda tmp: fig.savefig(tmp, format=fmt, **savefig))


def replace_dir(tmp: str | Path, final: str | Path) -> None:
    """Move the finished directory `tmp` to `final`, replacing whatever is there. `os.replace` cannot
    overwrite a non-empty directory, so an old `final` is moved aside first and removed after: at every
    moment `final` is either the old directory or the new one, never a mix."""
    tmp, final = Path(tmp), Path(final)
    if not final.exists():
        os.replace(tmp, final)
        return
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def model_device(model):
    """The device of a model's first parameter (CPU for a parameter-less wrapper)."""
    import torch

    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def hub_offline_mode() -> bool:
    """True when the user asked the Hugging Face libraries to stay offline."""
    try:
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            return True
    except Exception:  # an old or broken huggingface_hub: fall back to the variables
        pass
    return any(os.environ.get(k, "0").lower() in ("1", "true", "yes", "on")
               for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_unreachable_reason(timeout: float = 5.0) -> str | None:
    """None if the hub endpoint accepts a TCP connection, else why not.

    Without this probe an offline machine spends tens of seconds in huggingface_hub's retry loop before
    failing; a TCP connect fails within milliseconds (DNS) or `timeout` seconds. In offline mode no probe
    is made: the HF libraries then read only their local cache, and fail fast themselves.
    """
    if hub_offline_mode():
        return None
    try:  # the endpoint the HF libraries will actually use (HF_ENDPOINT, read at their import)
        from huggingface_hub import constants

        endpoint = constants.ENDPOINT
    except Exception:
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urllib.parse.urlparse(endpoint)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return f"the Hugging Face hub ({endpoint}) is unreachable from this machine ({e})"
    return None


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of the first processor in /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def processor() -> str:
    """The CPU's model name and the vector extensions that decide the kernels' paths (vLLM's and fusedkv's)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in cpu_flags()]
    return f"{name} ({', '.join(isa) or 'no AVX2'})"


def cache_dir(*parts: str) -> Path:
    """The per-user cache directory for built artefacts: $FUSEDKV_CACHE, else $XDG_CACHE_HOME/fusedkv,
    else ~/.cache/fusedkv (not created here)."""
    root = os.environ.get("FUSEDKV_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fusedkv")
    return Path(root, *parts)
