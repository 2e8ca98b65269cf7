"""Fixtures for the reliability suite: the real `fusedkv` CLI in a child process, one tiny checkpoint per
session, and a full disk.

Every case runs `python -m fusedkv.cli ARGS` as its own process, so exit codes, stderr and tracebacks are
the ones a user sees: forked from a process that imported fusedkv once (tests/_cli.py), or a fresh
interpreter with FUSEDKV_TEST_FRESH=1 (slower, same assertions); `test_cli_policy.py` checks that both agree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._cli import Result, Runner

REPO = Path(__file__).resolve().parents[2]


def base_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "FUSEDKV_DEBUG"}
    env.update(PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore")
    env.update(extra)
    return env


class CLI:
    """`cli(*args, env=..., cwd=..., timeout=...)` runs `fusedkv ARGS` in a child process (tests/_cli.py)."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.runner = Runner(workdir)

    def __call__(self, *args, env: dict | None = None, cwd: Path | None = None, timeout: float = 120) -> Result:
        return self.runner.run("fusedkv.cli", args, env=base_env(**(env or {})), cwd=cwd or self.workdir,
                               timeout=timeout)

    def close(self):
        self.runner.close()


@pytest.fixture(scope="session")
def data(tmp_path_factory) -> Path:
    """A prepared nano corpus (120k characters of the built-in text, a 512-token BPE) for the runs the
    reliability cases train: one preparation per session, shared by every module that trains."""
    from fusedkv.data import prepare_dataset, read_builtin_text

    text = tmp_path_factory.mktemp("corpus") / "small.txt"
    text.write_text(read_builtin_text(limit_chars=120_000))
    out = tmp_path_factory.mktemp("data") / "nano-512"
    prepare_dataset(str(text), out, vocab_size=512, num_proc=1)
    return out


@pytest.fixture(scope="session")
def cli(tmp_path_factory):
    runner = CLI(tmp_path_factory.mktemp("cli-cases"))
    yield runner
    runner.close()


def assert_one_line_error(result: Result, code: int, *fragments: str) -> str:
    """Exit `code`, no traceback, and a last stderr line `fusedkv ...: error: ...` holding every fragment."""
    assert result.returncode == code, (result.args, result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    line = result.error_line()
    assert line.startswith("fusedkv") and "error:" in line, line
    assert "internal error" not in line, line
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    return line


def _save_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["ROMEO: what light through yonder window breaks"] * 20,
                            trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|pad|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>").save_pretrained(path)


CONTEXT = 64  # the tiny checkpoint's max_position_embeddings


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A tiny FusedKV checkpoint (4 layers, hidden 64, context 64, vocab 300) with its tokenizer."""
    from tests.conftest import tiny_model

    path = tmp_path_factory.mktemp("tiny-ckpt")
    _save_tokenizer(path, 300)
    tiny_model("fusedkv", vocab_size=300, max_position_embeddings=CONTEXT).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def nan_ckpt(tmp_path_factory, tiny_ckpt) -> Path:
    """The tiny checkpoint with one weight NaN, as corrupted bytes in the weights give: loads, computes NaN."""
    from fusedkv import FusedKVForCausalLM

    path = tmp_path_factory.mktemp("nan-ckpt")
    model = FusedKVForCausalLM.from_pretrained(tiny_ckpt)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    model.save_pretrained(path)
    for f in tiny_ckpt.glob("tokenizer*"):
        shutil.copy2(f, path / f.name)
    return path


@pytest.fixture(scope="session")
def overflow_ckpt(tmp_path_factory, tiny_ckpt) -> Path:
    """The tiny checkpoint with finite weights whose logits overflow (final norm weight 3e38): passes the
    load-time weight check, computes NaN logits, as a diverged-but-finite model does."""
    from fusedkv import FusedKVForCausalLM

    path = tmp_path_factory.mktemp("overflow-ckpt")
    model = FusedKVForCausalLM.from_pretrained(tiny_ckpt)
    with torch.no_grad():
        model.model.norm.weight.fill_(3e38)
    model.save_pretrained(path)
    for f in tiny_ckpt.glob("tokenizer*"):
        shutil.copy2(f, path / f.name)
    return path


@pytest.fixture(scope="session")
def qwen3_src(tmp_path_factory) -> Path:
    """A tiny random Hugging Face Qwen3 checkpoint, as `fusedkv convert` takes."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    path = tmp_path_factory.mktemp("qwen3")
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def bad_files(tmp_path_factory) -> dict[str, Path]:
    """Inputs a user can pass by mistake: random bytes, an executable, Latin-1 text, an empty file, a
    directory, a missing path."""
    d = tmp_path_factory.mktemp("bad-files")
    rng = torch.Generator().manual_seed(0)
    (d / "random.bin").write_bytes(bytes(torch.randint(0, 256, (100_000,), generator=rng, dtype=torch.uint8).tolist()))
    shutil.copy(sys.executable if Path(sys.executable).stat().st_size < 50e6 else "/bin/sh", d / "program")
    (d / "latin1.txt").write_bytes(("hello world\n" * 50 + "caf\xe9 au lait\n").encode("latin-1"))
    (d / "empty.txt").write_text("")
    (d / "words.txt").write_text("the grass is green and the sky is blue\n" * 80)
    (d / "a-directory").mkdir()
    return {p.name: p for p in d.iterdir()} | {"missing": d / "no-such-file.txt"}


@pytest.fixture
def full_disk(tmp_path):
    """A directory on a 256 KiB tmpfs that is already full (root only; skipped otherwise)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "full"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with open(mnt / "filler", "wb", buffering=0) as f:  # fill it, leaving no free block
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.fixture(scope="session")
def tiny_val(tmp_path_factory, tiny_ckpt) -> Path:
    """A small prepared dataset tokenised with the tiny checkpoint's tokenizer, for `eval --val` (the
    default, the whole built-in corpus, takes minutes to tokenise on a small machine)."""
    from fusedkv.data import prepare_dataset

    text = tmp_path_factory.mktemp("val-text") / "romeo.txt"
    text.write_text("ROMEO: what light through yonder window breaks. " * 200)
    out = tmp_path_factory.mktemp("val-data")
    prepare_dataset(str(text), out, tokenizer=str(tiny_ckpt), num_proc=1)
    return out
