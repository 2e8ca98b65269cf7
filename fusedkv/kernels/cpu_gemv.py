"""Native weight products for CPU decoding (`cpu_gemv.c`): a few rows against a decode-layout weight.

A one-token decode step is a chain of matrix-vector products, so its time is the weight bytes divided
by how fast they are streamed. PyTorch's f32 product at one row (MKL) streams well below the memory's
rate and does not split one product across cores, and its 16-bit and int8 one-row kernels are bound by
arithmetic, not memory (`benchmarks/cpu_decode.py --kernels`; figures in `docs/cpu-decode.md`). This
kernel reads W^T ([in, out] row-major: the column-major weight of `fusedkv.model.packing`'s decode
layout) in long sequential runs and splits the output columns across threads. f32 weights only: the
reduced-precision formats keep PyTorch's kernels (`fusedkv.model.precision`), which were faster than
widening them in this loop.

Built on first use with the system C compiler (`cc -O3 -march=native -fopenmp`: the compiler picks
AVX-512 or AVX2 for this processor) into `~/.cache/fusedkv/native/`, under a name that hashes the
source, the compiler and the processor's flags, written atomically; loaded with ctypes. The library
links `libgomp.so.1` by its soname, which torch's own OpenMP runtime already holds in the process, so
both share one thread pool. No compiler, a failed build, or `FUSEDKV_NATIVE_KERNELS=0`: `available()`
is False and every caller keeps PyTorch's kernels (one warning says why).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from ..utils import cpu_flags

SOURCE = Path(__file__).with_name("cpu_gemv.c")
# Up to this many input rows the native kernel runs (each extra row re-reads W^T from L1, not memory);
# above it PyTorch's GEMM is the faster (`benchmarks/cpu_decode.py --kernels`).
MAX_ROWS = 4
_ARGTYPES = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
             ctypes.c_void_p, ctypes.c_int, ctypes.c_int]


def _cache_dir() -> Path:
    root = os.environ.get("FUSEDKV_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                           os.path.expanduser("~/.cache"), "fusedkv")
    return Path(root) / "native"


def _build(compiler: str) -> Path:
    """Compile `cpu_gemv.c` for this processor, or return the cached library."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    flags = " ".join(sorted(cpu_flags()))
    key = hashlib.sha256("\0".join([SOURCE.read_text(), version, flags, platform.machine()]).encode())
    target = _cache_dir() / f"cpu_gemv-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # same filesystem: the rename is atomic
        built = Path(tmp) / target.name
        cmd = [compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-o", str(built), str(SOURCE)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("FUSEDKV_NATIVE_KERNELS", "1") in ("0", "", "false", "no"):
        return None
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None  # the build flags and the libgomp sharing are what was tested
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    try:
        if compiler is None:
            raise RuntimeError("no C compiler (cc or gcc) on PATH")
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        warnings.warn(f"fusedkv: the native CPU decode kernel is unavailable ({exc}); decoding uses PyTorch's "
                      "kernels, which are slower at batch 1. Install a C compiler with OpenMP (gcc) to enable it, "
                      "or set FUSEDKV_NATIVE_KERNELS=0 to silence this.", stacklevel=3)
        return None
    lib.gemv_f32.argtypes, lib.gemv_f32.restype = _ARGTYPES, None
    return lib


def available() -> bool:
    """True when the native kernel is built and loaded on this machine (decided once per process)."""
    return _library() is not None


def redecide() -> None:
    """Forget the decision, so the next call re-reads FUSEDKV_NATIVE_KERNELS and CC (tests, benchmarks)."""
    _library.cache_clear()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` for a few rows, or None where this kernel does not apply (the caller
    then runs its own product): `weight` f32 [out, in] column-major (stride(0) == 1, as the decode layout
    stores it; a row slice of a packed buffer is fine), `x` f32 on CPU with at most `MAX_ROWS` rows, no
    autograd, not under torch.compile (which cannot trace a foreign call), `bias` f32 and contiguous."""
    if (weight.stride(0) != 1 or weight.dtype != torch.float32 or x.dtype != torch.float32
            or x.device.type != "cpu" or torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
            or torch.compiler.is_compiling() or not available()):
        return None
    out_features, in_features = weight.shape
    rows = x.numel() // in_features
    if rows > MAX_ROWS or rows == 0:
        return None
    x2 = x.reshape(rows, in_features)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    if bias is not None and (bias.dtype != torch.float32 or bias.stride(0) != 1):
        return None
    y = torch.empty(*x.shape[:-1], out_features)
    _library().gemv_f32(x2.data_ptr(), rows, in_features, weight.data_ptr(), weight.stride(1),
                        None if bias is None else bias.data_ptr(), y.data_ptr(), out_features,
                        torch.get_num_threads())
    return y
