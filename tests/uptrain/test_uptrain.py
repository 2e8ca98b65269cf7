"""`fusedkv uptrain` end to end through the real CLI, on tiny random checkpoints built with transformers' own
classes (one per imported family), a kill in the middle of training and a re-run, torchrun (DDP; FSDP2 with
sharded checkpoints, killed and resumed), and a vocabulary padded past the tokenizer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import _cli as cli_process

REPO = Path(__file__).resolve().parents[2]
VOCAB = 320
STEPS = 4
# nano's recipe (context 64, 8 x 64-token global batch, accumulation 2), a few steps, checkpoints every step.
RECIPE = ("--preset", "nano", "--set", "threads=1", "--set", "eval_every=2", "--set", "ckpt_every=1",
          "--set", "final_eval_batches=3", "--set", "warmup_steps=1")
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=128)


def _qwen3(tied: bool = False):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**SHAPE, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                        tie_word_embeddings=tied))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**SHAPE, num_key_value_heads=2, intermediate_size=128))


def _deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM(DeepseekV3Config(
        **SHAPE, num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16))


# The fast tier (-m 'not slow') runs the whole journey once, in its shortest form (test_uptrain_padded_vocabulary:
# 2 steps, no re-run); the families are the full suite's.
FAMILIES = [pytest.param(t, build, id=t) for t, build in
            (("qwen3", _qwen3), ("llama", _llama), ("deepseek_v3", _deepseek_v3))]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from fusedkv.data import read_builtin_text

    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(read_builtin_text(limit_chars=120_000))
    return path


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, corpus) -> Path:
    from fusedkv.data.tokenizer import train_bpe_tokenizer

    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    tok = train_bpe_tokenizer([corpus.read_text()], VOCAB, out)
    assert len(tok) == VOCAB
    return out


def _checkpoint(root: Path, model_type: str, build, tokenizer_dir: Path, name: str | None = None) -> Path:
    path = root / (name or model_type)
    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        model = build()
        assert model.config.model_type == model_type
        model.save_pretrained(path)
        for f in tokenizer_dir.iterdir():
            (path / f.name).write_bytes(f.read_bytes())
    return path


def _env(tmp_path: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "FUSEDKV_DEBUG"}
    env.update(PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", FUSEDKV_DATA_DIR=str(tmp_path / "data-cache"),
               TRANSFORMERS_VERBOSITY="error", **extra)
    return env


def _uptrain(tmp_path, *args, env=None, timeout=600) -> cli_process.Result:
    return cli_process.fusedkv("uptrain", *args, cwd=REPO, env=env or _env(tmp_path), timeout=timeout)


def _check_report(out: Path, plan: str, steps: int) -> dict:
    report = json.loads((out / "report.json").read_text())
    assert report["plan"] == plan and report["train"]["steps"] == steps
    models = report["models"]
    assert set(models) == {"teacher", "before", "after"}
    assert all(0 < m["val_loss"] < 20 and m["val_ppl"] > 1 for m in models.values())
    # The report's "after" is the trainer's own final validation, on the same windows.
    assert models["after"]["val_loss"] == pytest.approx(report["train"]["val_loss"], rel=1e-5)
    # The converted model before training is what the trainer measured at step 0.
    assert models["before"]["val_loss"] == pytest.approx(report["train"]["init_val_loss"], rel=1e-5)
    gap = models["before"]["val_loss"] - models["teacher"]["val_loss"]
    assert report["conversion_gap"] == pytest.approx(gap)
    if gap > 0:
        want = (models["before"]["val_loss"] - models["after"]["val_loss"]) / gap
        assert report["recovered_share"] == pytest.approx(want)
    cache = report["kv_cache_bytes_per_token"]
    assert cache["student"] < cache["teacher"]
    assert (out / "curves.png").stat().st_size > 10_000 and (out / "report.md").is_file()
    assert "recovered share" in (out / "report.md").read_text()
    assert (out / "train" / "final" / "model.safetensors").is_file()
    return report


@pytest.mark.slow
@pytest.mark.parametrize("model_type,build", FAMILIES)
def test_uptrain_end_to_end(model_type, build, tmp_path, corpus, tokenizer_dir):
    """convert -> evaluate -> distil -> evaluate -> report, through `fusedkv uptrain`; the teacher is
    transformers' own class; a second run of the same command has nothing left to do."""
    src = _checkpoint(tmp_path, model_type, build, tokenizer_dir)
    out = tmp_path / "run"
    proc = _uptrain(tmp_path, src, out, "--plan", "fusedkv", "--data", corpus, "--max-steps", STEPS, *RECIPE)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = _check_report(out, "fusedkv", STEPS)
    assert report["models"]["teacher"]["class"] == type(build()).__name__
    assert report["models"]["before"]["class"] == "FusedKVForCausalLM"
    assert json.loads((out / "converted" / "config.json").read_text())["kv_sharing"] == "fusedkv"
    again = _uptrain(tmp_path, src, out, "--plan", "fusedkv", "--data", corpus, "--max-steps", STEPS, *RECIPE)
    assert again.returncode == 0, again.stderr[-3000:]
    assert all(f"{stage}: done" in again.stdout for stage in ("convert", "evaluate teacher", "evaluate before",
                                                                "train", "evaluate after"))


@pytest.mark.slow
def test_uptrain_resumes_after_a_kill(tmp_path, corpus, tokenizer_dir):
    """SIGKILL in the middle of training; the same command finishes the run from its last checkpoint, with
    the report of an uninterrupted run (same steps, same structure). The source ties its embeddings, as
    Qwen3-0.6B and SmolLM2 do: its mid-training checkpoints are saved and the head stays tied (issue 41, 4)."""
    src = _checkpoint(tmp_path, "qwen3", lambda: _qwen3(tied=True), tokenizer_dir, name="qwen3-tied")
    out = tmp_path / "run"
    args = [src, out, "--plan", "fusedkv-lite", "--data", corpus, "--max-steps", 6, *RECIPE]
    env = _env(tmp_path, FUSEDKV_TRAIN_STEP_SLEEP="1.5")  # time to kill it between steps
    # A forked `python -m fusedkv.cli` (tests/_cli.py), in a session of its own.
    proc = cli_process.start_module("fusedkv.cli", "uptrain", *args, cwd=REPO, env=env)
    ckpts = out / "train" / "checkpoints"
    deadline = time.time() + 300
    while time.time() < deadline and not (ckpts.is_dir() and len(list(ckpts.glob("step-*"))) >= 2):
        assert proc.poll() is None, "uptrain ended before it could be killed"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "train" / "final").exists() and not (out / "report.json").exists()
    proc = _uptrain(tmp_path, *args)  # the same command
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "convert: done" in proc.stdout and "resuming" in proc.stdout
    report = _check_report(out, "fusedkv-lite", 6)
    assert len(report["curve"]) == 6
    from fusedkv import FusedKVForCausalLM

    final = FusedKVForCausalLM.from_pretrained(out / "train" / "final")
    assert final.lm_head.weight is final.model.embed_tokens.weight


@pytest.mark.slow
def test_uptrain_under_torchrun_ddp(tmp_path, corpus, tokenizer_dir):
    """Two ranks (gloo, CPU) train; rank 0 converts, evaluates and reports."""
    src = _checkpoint(tmp_path, "qwen3", _qwen3, tokenizer_dir)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "fusedkv.cli", "uptrain", src, out, "--plan", "fusedkv", "--data", corpus, "--max-steps", 2,
           "--distributed", "ddp", "--device", "cpu", *RECIPE]
    proc = subprocess.run(list(map(str, cmd)), cwd=REPO, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    _check_report(out, "fusedkv", 2)
    assert "2 ranks" in proc.stdout


def test_uptrain_padded_vocabulary(tmp_path, corpus, tokenizer_dir):
    """A Llama whose vocab_size (384) is padded past its tokenizer (320 tokens), as published Llama / Qwen2.5 /
    DeepSeek checkpoints are: the data is tokenised with the 320 tokens and the whole journey runs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def padded():
        return LlamaForCausalLM(LlamaConfig(**{**SHAPE, "vocab_size": VOCAB + 64}, num_key_value_heads=2,
                                            intermediate_size=128))

    src = _checkpoint(tmp_path, "llama", padded, tokenizer_dir)
    out = tmp_path / "run"
    proc = _uptrain(tmp_path, src, out, "--plan", "fusedkv-lite", "--data", corpus, "--max-steps", 2, *RECIPE)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check_report(out, "fusedkv-lite", 2)
    assert json.loads((out / "converted" / "config.json").read_text())["vocab_size"] == VOCAB + 64


def _process_tree(root: int) -> list[int]:
    """`root` and every process descended from it (from /proc), deepest first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    order, todo = [], [root]
    while todo:
        pid = todo.pop()
        order.append(pid)
        todo.extend(children.get(pid, []))
    return order[::-1]


@pytest.mark.slow
def test_uptrain_under_torchrun_fsdp_resumes_sharded(tmp_path, corpus, tokenizer_dir):
    """FSDP2 on two ranks (gloo, CPU) with sharded (DCP) checkpoints: SIGKILL the whole torchrun group in the
    middle of training; the same command resumes from the last sharded checkpoint, finishes and reports."""
    src = _checkpoint(tmp_path, "llama", _llama, tokenizer_dir)
    out = tmp_path / "run"
    cmd = list(map(str, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                         "fusedkv.cli", "uptrain", src, out, "--plan", "fusedkv", "--data", corpus, "--max-steps", 4,
                         "--distributed", "fsdp", "--device", "cpu", "--set", "checkpoint_format=sharded", *RECIPE]))
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(tmp_path, FUSEDKV_TRAIN_STEP_SLEEP="2"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    ckpts = out / "train" / "checkpoints"
    deadline = time.time() + 600
    while time.time() < deadline and not (ckpts.is_dir() and len(list(ckpts.glob("step-*"))) >= 2):
        assert proc.poll() is None, "uptrain ended before it could be killed"
        time.sleep(0.1)
    tree = _process_tree(proc.pid)  # torchrun starts each worker in a session of its own: kill them all
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # ended meanwhile
            pass
    proc.wait()
    saved = sorted(ckpts.glob("step-*"))
    assert saved and not (out / "train" / "final").exists()
    assert all((c / "dcp" / ".metadata").is_file() and (c / "rank-00001.pt").is_file() for c in saved)
    done = subprocess.run(cmd, cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "convert: done" in done.stdout and "resuming" in done.stdout, done.stdout
    report = _check_report(out, "fusedkv", 4)
    assert len(report["curve"]) == 4
