"""llama.cpp as an optional peer in the CPU decode benchmark: the same vanilla weights, converted with
llama.cpp's own converter and run through its Python bindings (`pip install fusedkv[llamacpp]`).

Nothing of llama.cpp is part of this project. The bindings come from the package registry
(llama-cpp-python builds llama.cpp from source with `-march=native`); the converter script
`convert_hf_to_gguf.py` ships only in llama-cpp-python's source distribution, so it is located at
run time in an unpacked or packed sdist:

    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d ~/.cache/fusedkv
    export FUSEDKV_LLAMA_CPP_SRC=~/.cache/fusedkv/llama_cpp_python-0.3.36.tar.gz   # or --llamacpp-src

`export_hf_checkpoint` writes the bench model's transformers Qwen3 weights with a byte-level BPE
trained here; `convert_to_gguf` runs the converter on it. The converter recognises a tokenizer's
pre-tokenizer by a fingerprint table that a freshly trained BPE is not in; ours splits text with
GPT-2's pattern, so unknown fingerprints are mapped to llama.cpp's `gpt-2` pre-tokenizer (the
benchmark feeds token ids, so this only matters for text). `LlamaCppRunner` times prefill and greedy
decode of given token ids like `fusedkv.generation.generate` does, single sequence.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
KV_TYPES = {"f32": 0, "f16": 1}  # ggml_type ids for type_k / type_v
SRC_ENV = "FUSEDKV_LLAMA_CPP_SRC"
CONVERTER = "convert_hf_to_gguf.py"
INSTALL_HINT = "pip install 'fusedkv[llamacpp]' (builds llama.cpp from source, ~6 min on 2 cores)"

# Run in a subprocess: the converter, with unknown BPE fingerprints mapped to the `gpt-2` pre-tokenizer.
_CONVERT_WRAPPER = """
import runpy, sys
root = sys.argv[1]
sys.path.insert(0, root)
import conversion.base as base
original = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError:  # a BPE trained here: GPT-2's split pattern
        return "gpt-2"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [root + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def available() -> str | None:
    """None when the bindings import, else why not (a line to show instead of the llama.cpp rows)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"llama.cpp rows skipped: llama-cpp-python is not installed ({e}); {INSTALL_HINT}"
    return None


def find_converter(src: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None) -> Path:
    """The directory holding `convert_hf_to_gguf.py` (and its `conversion/`, `gguf-py/`), from `src`
    or $FUSEDKV_LLAMA_CPP_SRC: an sdist .tar.gz (unpacked once next to itself or into `cache_dir`), an
    unpacked sdist, or a llama.cpp checkout."""
    src = src or os.environ.get(SRC_ENV)
    if not src:
        raise ValueError(
            f"llama.cpp's converter was not found: pass --llamacpp-src or set {SRC_ENV} to llama-cpp-python's "
            "source distribution (pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d DIR)")
    path = Path(src).expanduser()
    if not path.exists():
        raise ValueError(f"llama.cpp source {path}: no such file or directory")
    if path.is_file():
        if not tarfile.is_tarfile(path):
            raise ValueError(f"llama.cpp source {path}: not a .tar.gz source distribution or a directory")
        target = Path(cache_dir or path.parent) / (path.name.removesuffix(".tar.gz") + "-converter")
        if not (target / "done").exists():
            _unpack_converter(path, target)
        path = target
    for root in (path, path / "vendor" / "llama.cpp", *path.glob("*/vendor/llama.cpp")):
        if (root / CONVERTER).is_file():
            return root
    raise ValueError(f"llama.cpp source {path}: no {CONVERTER} in it (expected vendor/llama.cpp/{CONVERTER})")


def _unpack_converter(archive: Path, target: Path) -> None:
    """Extract only the converter, its `conversion` package and `gguf-py` from the sdist."""
    wanted = (CONVERTER, "conversion/", "gguf-py/")
    with tarfile.open(archive) as tar:
        members = []
        for m in tar.getmembers():
            parts = m.name.split("/vendor/llama.cpp/", 1)
            if len(parts) == 2 and parts[1].startswith(wanted) and (m.isfile() or m.isdir()):
                m.name = parts[1]
                members.append(m)
        if not members:
            raise ValueError(f"{archive}: no vendor/llama.cpp/{CONVERTER} in this archive")
        tar.extractall(target, members=members, filter="data")
    (target / "done").write_text("ok\n")


def export_hf_checkpoint(hf_model, out_dir: str | os.PathLike, text_chars: int = 2_000_000) -> Path:
    """Save a transformers Qwen3 model with a byte-level BPE of its vocabulary size (trained on the
    built-in corpus) — the input llama.cpp's converter takes."""
    from ..data.sources import BuiltinSource
    from ..data.tokenizer import train_bpe_tokenizer

    out = Path(out_dir)
    hf_model.save_pretrained(out)
    vocab = hf_model.config.vocab_size
    tok = train_bpe_tokenizer((doc for doc in BuiltinSource()), vocab, out / "tokenizer", max_chars=text_chars)
    tok.save_pretrained(out)
    return out


def convert_to_gguf(hf_dir: str | os.PathLike, out_file: str | os.PathLike, outtype: str, converter_root: Path,
                    python: str = sys.executable) -> Path:
    """Run llama.cpp's converter on a transformers checkpoint (`outtype` in GGUF_TYPES)."""
    if outtype not in GGUF_TYPES:
        raise ValueError(f"GGUF type {outtype!r}: choose one of {', '.join(GGUF_TYPES)}")
    out = Path(out_file)
    cmd = [python, "-c", _CONVERT_WRAPPER, str(converter_root), str(hf_dir), "--outfile", str(out),
           "--outtype", outtype]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not out.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"llama.cpp's converter failed ({outtype}): {' | '.join(tail)}")
    return out


class LlamaCppRunner:
    """One GGUF model in llama.cpp with a given KV type and thread count; times prefill + greedy decode."""

    def __init__(self, gguf_path: str | os.PathLike, n_ctx: int, threads: int, kv_type: str = "f16",
                 n_batch: int = 512, flash_attn: bool = False):
        from llama_cpp import Llama

        if kv_type not in KV_TYPES:
            raise ValueError(f"KV type {kv_type!r}: choose one of {', '.join(KV_TYPES)}")
        self.llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                         n_threads=threads, n_threads_batch=threads, type_k=KV_TYPES[kv_type],
                         type_v=KV_TYPES[kv_type], flash_attn=flash_attn, logits_all=False, verbose=False)
        self.n_vocab = self.llm.n_vocab()

    def logits_last(self):
        """The last evaluated token's logits, read in place from llama.cpp (the bindings copy logits
        only with logits_all=True, which would make llama.cpp compute them for every prompt token)."""
        import llama_cpp
        import numpy as np

        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.n_vocab,))

    def generate(self, prompt: list[int], new_tokens: int) -> dict:
        """Greedy decode; returns tokens, ttft_s and the per-step times like `GenerationResult`."""
        llm = self.llm
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        token = int(self.logits_last().argmax())
        ttft = time.perf_counter() - start
        tokens, steps = [token], []
        for _ in range(new_tokens - 1):
            t0 = time.perf_counter()
            llm.eval([token])
            token = int(self.logits_last().argmax())
            steps.append(time.perf_counter() - t0)
            tokens.append(token)
        return dict(tokens=tokens, ttft_s=ttft, step_s=steps)

    def close(self) -> None:
        self.llm.close()
