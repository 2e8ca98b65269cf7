"""The native CPU decode kernels (`cpu_gemv.c`, `cpu_decode_attention.c`, `cpu_decode_step.c`): how they
are built and loaded.

Built on first use with the system C compiler (`cc -O3 -march=native -fopenmp`: the compiler picks
AVX-512 or AVX2 for this processor) into `~/.cache/fusedkv/native/`, under a name that hashes the
sources, the compiler and the processor's flags, written atomically; loaded with ctypes. The library
links `libgomp.so.1` by its soname, which torch's own OpenMP runtime already holds in the process, so
both share one thread pool. No compiler, a failed build, or `FUSEDKV_NATIVE_KERNELS=0`: `available()`
is False and every caller keeps PyTorch's kernels (one warning says why). What the kernels do and when
they run: `fusedkv.kernels.cpu_gemv`, `fusedkv.kernels.cpu_attention` and `fusedkv.engine.native_step`.
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

from ..utils import cache_dir, cpu_flags

SOURCES = [Path(__file__).with_name(name) for name in ("cpu_gemv.c", "cpu_decode_attention.c", "cpu_decode_step.c",
                                                       "cpu_paged_attention.c", "cpu_kivi_attention.c")]
HEADERS = [Path(__file__).with_name(name) for name in ("cpu_kernels.h", "cpu_kivi_avx2.h")]
BLOCK_ISAS = (None, "avx2", "avx512-bf16")  # by the code gemv_blocks_isa returns
P, I, L, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
SIGNATURES = {  # C function -> (argument types, result type)
    "gemv_f32": ([P, I, I, P, L, P, P, I, I], None),
    "gemv_bf16_blocks": ([P, I, I, P, L, P, P, P, I, I], I),
    "gemv_int8_blocks": ([P, I, I, P, L, P, P, P, I, I], I),
    "gemv_int4_blocks": ([P, I, I, P, L, P, P, P, I, I], I),
    "gemv_blocks_isa": ([], I),
    "gemv_f16_blocks": ([P, I, I, P, L, P, P, I, I], I),
    "has_f16_blocks": ([], I),
    "decode_attention": ([P, I, I, I, I, I, F, I, I, P, P, L, L, L, P, P, L, I, P, P, L, L, L, P, P, L, P, P, I], I),
    "decode_step": ([P, P, P, L, I], I),
    # cpu_kivi_attention.c (the KIVI cache read in place, fusedkv.kernels.cpu_kivi)
    "kivi_attention": ([P, I, I, I, F, P, I, P, P, P, P, L, I, P, P, P, P, L, P, I, P, I], I),
    "kivi_flush": ([P, P, L], I),
    # cpu_paged_attention.c (vLLM's paged cache, fusedkv.serving.paged)
    "paged_attention": ([P, I, I, I, I, F, I, F, I, P, P, P, L, I, L, L, I, I, P, P, P, P, L, I, P, P, P, P, L, P, I],
                        I),
    "paged_loops": ([I, I, I, I, I], I),
}


def _build(compiler: str) -> Path:
    """Compile the kernels for this processor, or return the cached library."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    flags = " ".join(sorted(cpu_flags()))
    texts = [p.read_text() for p in SOURCES + HEADERS]
    key = hashlib.sha256("\0".join([*texts, version, flags, platform.machine()]).encode())
    target = cache_dir("native") / f"fusedkv-cpu-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # same filesystem: the rename is atomic
        built = Path(tmp) / target.name
        cmd = [compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-o", str(built),
               *map(str, SOURCES), "-lm"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot run (decided once per process)."""
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
        warnings.warn(f"fusedkv: the native CPU decode kernels are unavailable ({exc}); decoding uses PyTorch's "
                      "kernels, which are slower at batch 1. Install a C compiler with OpenMP (gcc) to enable it, "
                      "or set FUSEDKV_NATIVE_KERNELS=0 to silence this.", stacklevel=3)
        return None
    for name, (argtypes, restype) in SIGNATURES.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = argtypes, restype
    # the block products (cpu_gemv.c) as compiled here: AVX-512 BF16 dot products, AVX2 FMAs over widened weights
    lib.blocks_isa = BLOCK_ISAS[lib.gemv_blocks_isa()]
    lib.f16_blocks = bool(lib.has_f16_blocks())  # f16 blocks: AVX2 + F16C conversions, on any such processor
    return lib


def available() -> bool:
    """True when the native kernel is built and loaded on this machine (decided once per process)."""
    return library() is not None


def redecide() -> None:
    """Forget the decision, so the next call re-reads FUSEDKV_NATIVE_KERNELS and CC (tests, benchmarks)."""
    library.cache_clear()


# cpu_paged_attention.c: the cache element types it reads (its `kind` argument), its source bound, and the block
# layouts it reads (its `layout` argument): key and value rows; keys transposed (vLLM's "vec" ISA); vLLM's "amx"
# ISA packing (keys as AMX B tiles of 16 tokens x channel pairs, values as 16 channels x token pairs). The fp8
# kinds are vLLM's 8-bit caches (`--kv-cache-dtype fp8`, uint8 tensors viewed as these dtypes).
PAGED_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
PAGED_MAX_SOURCES = 2
PAGED_ROWS, PAGED_KEYS_TRANSPOSED, PAGED_AMX = 0, 1, 2
PAGED_LAYOUTS = (PAGED_ROWS, PAGED_KEYS_TRANSPOSED, PAGED_AMX)


def paged_fits(dtype: torch.dtype, k_count: int, v_count: int, layout: int | None) -> bool:
    """Whether the paged kernel takes a layer with this cache dtype, these sources and this block layout (one of
    `PAGED_LAYOUTS`, None: one it does not read), asked once per layer by the engine's selection. (The AMX packing
    exists, and is recognised, only for blocks and heads of multiples of 16: what the kernel needs.)"""
    return (dtype in PAGED_KINDS and 1 <= k_count <= PAGED_MAX_SOURCES and 1 <= v_count <= PAGED_MAX_SOURCES
            and layout in PAGED_LAYOUTS)


# cpu_paged_attention.c's loops (its `choose_loops`), by the code `paged_loops` returns: the generic loops; AVX-512's
# register-blocked loops over f32 blocks or AMX-packed bf16 blocks; AVX2's loops over a kv head's query heads together
# with the two sources fused in registers.
PAGED_LOOPS = ("generic", "avx512", "avx512-amx", "avx2-grouped")


def paged_loops(dtype: torch.dtype, layout: int, head_dim: int, block_size: int) -> tuple[str, str]:
    """The loops the paged kernel, as built for this processor, takes for a layer's scores and for its values (one of
    `PAGED_LOOPS` each), for the benchmarks' report of each layer's kernel path."""
    lib = library()
    if lib is None:
        raise RuntimeError("the native CPU kernels are not built here")
    return tuple(PAGED_LOOPS[lib.paged_loops(PAGED_KINDS[dtype], layout, head_dim, block_size, which)]
                 for which in (0, 1))
