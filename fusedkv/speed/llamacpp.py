"""llama.cpp as an optional peer in the CPU decode benchmark: the same vanilla weights, converted with
llama.cpp's own converter and run through its Python bindings (`pip install fusedkv[llamacpp]`).

Nothing of llama.cpp is part of this project. The bindings come from the package registry
(llama-cpp-python builds llama.cpp from source with `-march=native`); the converter script
`convert_hf_to_gguf.py` ships only in llama-cpp-python's source distribution, so it is located at
run time in an unpacked or packed sdist:

    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d ~/.cache/fusedkv
    export FUSEDKV_LLAMA_CPP_SRC=~/.cache/fusedkv/llama_cpp_python-0.3.36.tar.gz   # or --llamacpp-src

(`fetch_sdist` runs that download when neither is given and the file is not in ~/.cache/fusedkv yet.)

`export_hf_checkpoint` writes the bench model's transformers Qwen3 weights with a byte-level BPE
trained here; `convert_to_gguf` runs the converter on it. The converter recognises a tokenizer's
pre-tokenizer by a fingerprint table that a freshly trained BPE is not in; ours splits text with
GPT-2's pattern, so unknown fingerprints are mapped to llama.cpp's `gpt-2` pre-tokenizer (the
benchmark feeds token ids, so this only matters for text). The 4-bit files (Q4_0, Q4_K_M) are what
llama.cpp's own quantizer makes from the f32 conversion (`quantize_gguf`, `llama_model_quantize` through
the bindings, its default mixture: Q4_K_M keeps some tensors at Q6_K, and both keep the LM head at Q6_K
where its width is a multiple of 256). `LlamaCppRunner` times prefill and greedy decode of given token
ids like `fusedkv.generation.generate` does, single sequence; `fill_cache` gives it a cache of any length
without the prefill (the decode step's speed does not depend on what the cache holds); `window_logits`
returns every position's logits for perplexity.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")  # what the converter writes
QUANT_TYPES = {"q4_0": 2, "q4_k_m": 15}  # llama_ftype of what llama.cpp's quantizer writes from the f32 file
KV_TYPES = {"f32": 0, "f16": 1}  # ggml_type ids for type_k / type_v
SRC_ENV = "FUSEDKV_LLAMA_CPP_SRC"
CONVERTER = "convert_hf_to_gguf.py"
INSTALL_HINT = "pip install 'fusedkv[llamacpp]' (builds llama.cpp from source, ~6 min on 2 idle cores)"
VERSION = "0.3.36"  # the llama-cpp-python the extra pins; its sdist holds the converter
CACHE_DIR = Path("~/.cache/fusedkv")

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


def fetch_sdist(cache_dir: str | os.PathLike = CACHE_DIR, python: str = sys.executable) -> Path:
    """llama-cpp-python's source distribution in `cache_dir`, downloaded from the package registry (pip
    download, no build) the first time; ValueError with pip's last words when the registry cannot be reached."""
    cache = Path(cache_dir).expanduser()
    path = cache / f"llama_cpp_python-{VERSION}.tar.gz"
    if path.is_file():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    print(f"fetching llama-cpp-python=={VERSION}'s source distribution (~77 MB) into {cache}", file=sys.stderr)
    done = subprocess.run([python, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                           f"llama-cpp-python=={VERSION}", "-d", str(cache)], capture_output=True, text=True)
    if done.returncode != 0 or not path.is_file():
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-2:])
        raise ValueError(f"could not download llama-cpp-python=={VERSION}'s sdist ({tail}); pass --llamacpp-src "
                         f"or set {SRC_ENV} to a copy of it")
    return path


def find_converter(src: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None,
                   fetch: bool = False) -> Path:
    """The directory holding `convert_hf_to_gguf.py` (and its `conversion/`, `gguf-py/`), from `src`
    or $FUSEDKV_LLAMA_CPP_SRC: an sdist .tar.gz (unpacked once next to itself or into `cache_dir`), an
    unpacked sdist, or a llama.cpp checkout. Neither given: with `fetch`, the sdist of `fetch_sdist`."""
    src = src or os.environ.get(SRC_ENV) or (fetch_sdist() if fetch else None)
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


def export_vanilla_checkpoint(checkpoint: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """A trained vanilla fusedkv checkpoint as a transformers Qwen3 checkpoint (the same weight names and
    arithmetic), with the checkpoint's own tokenizer: the converter's input for the quality comparison.
    Checked on the way: both models give the same logits for a few random tokens."""
    import shutil

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ..model import FusedKVForCausalLM
    from ..plan import VANILLA

    model = FusedKVForCausalLM.from_pretrained(checkpoint).float().eval()
    c = model.config
    if c.kv_sharing != VANILLA or c.num_experts or c.kv_lora_rank or c.sliding_window:
        raise ValueError(f"{checkpoint}: llama.cpp runs the vanilla dense Qwen3 architecture only (this model: "
                         f"plan {c.kv_sharing}); train or convert one with --plan vanilla")
    qcfg = Qwen3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                       num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                       num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                       max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                       rope_theta=c.rope_parameters["rope_theta"], tie_word_embeddings=c.tie_word_embeddings,
                       bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id)
    hf = Qwen3ForCausalLM(qcfg).eval()
    hf.load_state_dict(model.state_dict(), strict=True)
    ids = torch.randint(0, c.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (hf(ids).logits - model(ids).logits).abs().max().item()
    if gap > 1e-3:
        raise RuntimeError(f"{checkpoint}: the transformers Qwen3 copy differs from the model (max |logit diff| "
                           f"{gap:.2g}); not exported")
    out = Path(out_dir)
    hf.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(checkpoint) / name).is_file():
            shutil.copy2(Path(checkpoint) / name, out / name)
    return out


def convert_to_gguf(hf_dir: str | os.PathLike, out_file: str | os.PathLike, outtype: str, converter_root: Path,
                    python: str = sys.executable) -> Path:
    """Run llama.cpp's converter on a transformers checkpoint (`outtype` in GGUF_TYPES), or, for a type in
    QUANT_TYPES, convert to f32 next to `out_file` and quantize that with llama.cpp's quantizer. An existing
    `out_file` is returned as it is: files are renamed into place only once complete (`_partial`)."""
    if outtype in QUANT_TYPES:
        f32 = Path(out_file).with_name(Path(out_file).stem + "-src-f32.gguf")
        if not f32.is_file():
            convert_to_gguf(hf_dir, f32, "f32", converter_root, python)
        return quantize_gguf(f32, out_file, outtype)
    if outtype not in GGUF_TYPES:
        raise ValueError(f"GGUF type {outtype!r}: choose one of {', '.join((*GGUF_TYPES, *QUANT_TYPES))}")
    out = Path(out_file)
    if out.is_file():
        return out  # written whole by an earlier run (see below): minutes of conversion saved
    part = _partial(out)
    cmd = [python, "-c", _CONVERT_WRAPPER, str(converter_root), str(hf_dir), "--outfile", str(part),
           "--outtype", outtype]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not part.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"llama.cpp's converter failed ({outtype}): {' | '.join(tail)}")
    return part.replace(out)


def _partial(out: Path) -> Path:
    """Where a GGUF file is written before it is renamed to `out`: a killed conversion never leaves a
    truncated file under the final name, so an existing `out` is always complete and is reused."""
    return out.with_name(out.stem + ".partial.gguf")


def quantize_gguf(src: str | os.PathLike, out_file: str | os.PathLike, qtype: str, threads: int = 1) -> Path:
    """llama.cpp's quantizer (`llama_model_quantize`, its default tensor-type mixture for `qtype`) on an
    f32 or f16 GGUF file."""
    import llama_cpp

    if qtype not in QUANT_TYPES:
        raise ValueError(f"quantized GGUF type {qtype!r}: choose one of {', '.join(QUANT_TYPES)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANT_TYPES[qtype]
    params.nthread = threads
    out = Path(out_file)
    if out.is_file():
        return out
    part = _partial(out)
    if llama_cpp.llama_model_quantize(str(src).encode(), str(part).encode(), params) != 0 or not part.is_file():
        raise RuntimeError(f"llama.cpp's quantizer failed ({src} -> {qtype})")
    return part.replace(out)


def gguf_weight_nbytes(path: str | os.PathLike) -> int:
    """Bytes a decode step streams for weights in a GGUF file: every tensor but the token embeddings (one
    row read per token); the file's own tensor types, so a quantizer's mixture is counted as it is."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors if not t.name.startswith("token_embd"))


def window_logits(gguf_path: str | os.PathLike, windows: list[list[int]], threads: int = 1,
                  kv_type: str = "f32") -> list:
    """Every position's logits (numpy [T, V]) of each window of token ids, each from an empty cache."""
    from llama_cpp import Llama

    n = max(len(w) for w in windows)
    llm = Llama(model_path=str(gguf_path), n_ctx=n, n_batch=n, n_ubatch=n, n_threads=threads,
                n_threads_batch=threads, type_k=KV_TYPES[kv_type], type_v=KV_TYPES[kv_type], logits_all=True,
                verbose=False)
    out = []
    try:
        for w in windows:
            llm.reset()
            llm.eval(w)
            out.append(llm.scores[:len(w)].copy())
    finally:
        llm.close()
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

    def fill_cache(self, context: int, seed: list[int]) -> None:
        """Hold `context` tokens in the cache without a prefill of that length (quadratic: minutes at 32k):
        evaluate `seed`, then set the sequence state to its cells repeated up to `context` (positions 0 ..
        context - 1). The values are a seed's, not a real prompt's; a step's cost does not depend on them."""
        import ctypes

        import llama_cpp

        llm = self.llm
        llm.reset()
        llm.eval(seed)
        size = llama_cpp.llama_state_seq_get_size(llm.ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        if llama_cpp.llama_state_seq_get_data(llm.ctx, buf, size, 0) != size:
            raise RuntimeError("llama.cpp did not return its sequence state")
        state = tile_seq_state(bytes(buf), context)
        state = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)  # the binding takes a uint8 pointer
        if llama_cpp.llama_state_seq_set_data(llm.ctx, state, len(state), 0) != len(state):
            raise RuntimeError(f"llama.cpp refused a sequence state of {context} cells (n_ctx={llm.n_ctx()})")
        llm.n_tokens = context

    def decode_from(self, context: int, token: int, new_tokens: int) -> list[float]:
        """Greedy decode of `new_tokens` steps after the first `context` cached tokens (those after are
        dropped first: llama-cpp-python's `eval` removes the cells from `n_tokens` on); the step times."""
        llm = self.llm
        llm.n_tokens = context
        steps = []
        for _ in range(new_tokens):
            t0 = time.perf_counter()
            llm.eval([token])
            token = int(self.logits_last().argmax())
            steps.append(time.perf_counter() - t0)
        return steps

    def close(self) -> None:
        self.llm.close()


def tile_seq_state(state: bytes, cells: int) -> bytes:
    """A llama.cpp sequence state (`llama_state_seq_get_data`, one stream, one sequence) of n cells made into
    one of `cells` cells: positions 0 .. cells - 1, every layer's K rows and V (row- or column-wise, as the
    cache stores it) repeated. The layout is llama.cpp's `llama_kv_cache::state_write` (0.3.36's llama.cpp);
    anything else raises ValueError."""
    import numpy as np

    at = 0

    def take(fmt: str, count: int = 1):
        nonlocal at
        arr = np.frombuffer(state, dtype=fmt, count=count, offset=at)
        at += arr.nbytes
        return arr

    def blob(nbytes: int) -> bytes:
        nonlocal at
        at += nbytes
        return state[at - nbytes:at]

    head = take("<u4", 2).tobytes() + take("<u4").tobytes()  # magic, seq id; streams
    if int(np.frombuffer(head[8:], "<u4")[0]) != 1:
        raise ValueError("llama.cpp sequence state with more than one stream")
    n = int(take("<u4")[0])
    meta = take("<i4", 3 * n).reshape(n, 3)  # pos, n_seq_id, seq_id
    if n == 0 or not (meta[:, 1] == 1).all() or not (meta[:, 0] == np.arange(n)).all():
        raise ValueError("unexpected llama.cpp sequence state (cells with extensions or not from one prompt)")
    v_trans, n_layer = (int(x) for x in take("<u4", 2))
    reps = -(-cells // n)

    def rows(data: bytes, row: int) -> bytes:
        return (data * reps)[:cells * row]

    out = [head, np.uint32(cells).tobytes()]
    pos = np.arange(cells, dtype="<i4")
    out.append(np.stack([pos, np.ones_like(pos), np.full_like(pos, meta[0, 2])], 1).tobytes())
    out.append(np.array([v_trans, n_layer], "<u4").tobytes())
    for _ in range(n_layer):  # K: one row per cell
        ktype, krow = take("<i4").tobytes(), int(take("<u8")[0])
        out += [ktype, np.uint64(krow).tobytes(), rows(blob(n * krow), krow)]
    for _ in range(n_layer):
        vtype = take("<i4").tobytes()
        if not v_trans:
            vrow = int(take("<u8")[0])
            out += [vtype, np.uint64(vrow).tobytes(), rows(blob(n * vrow), vrow)]
        else:  # one row per channel, one element per cell
            el, width = (int(x) for x in take("<u4", 2))
            out += [vtype, np.array([el, width], "<u4").tobytes()]
            out += [rows(blob(n * el), el) for _ in range(width)]
    if at != len(state):
        raise ValueError(f"llama.cpp sequence state of {len(state)} bytes, {at} understood: another format")
    return b"".join(out)
