"""`fusedkv train`: help text, registration, the end-to-end path, --resume, --init-from, errors."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from train_helpers import REPO, subprocess_env, train_cli
from transformers import AutoTokenizer

from fusedkv import FusedKVForCausalLM
from fusedkv.train import command


def test_help_reads_well(capsys):
    with pytest.raises(SystemExit) as e:
        command.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--preset",
        "--plan",
        "--config",
        "--set",
        "--out",
        "--resume",
        "--max-steps",
        "--data",
        "--distributed",
        "--compile",
        "--grad-checkpointing",
        "--rope-base",
        "--init-from",
    ):
        assert flag in text
    assert "runs/tiny-fusedkv" in text and "examples:" in text


def test_register_adds_train_subcommand():
    parser = argparse.ArgumentParser(prog="fusedkv")
    command.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", "--preset", "nano", "--set", "lr=1e-3", "--set", "seed=2"])
    assert args.func is command.handle and args.sets == ["lr=1e-3", "seed=2"]
    cfg = command.build_config(args)
    assert cfg.preset == "nano" and cfg.lr == 1e-3 and cfg.seed == 2 and cfg.out_dir == "runs/nano-fusedkv"


def test_print_config_and_bad_values(capsys):
    assert command.main(["--preset", "nano", "--plan", "yoco", "--print-config"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["kv_sharing"] == "yoco" and cfg["seq_len"] == 64
    assert command.main(["--set", "warmup_stepz=3"]) == 2
    assert "warmup_steps" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_end_to_end_resume_and_init_from(tmp_path, corpus_file, capsys):
    out = tmp_path / "runs" / "nano"
    # The default path (raw text in, data prepared next to the run), shortened: nano preset, 3 steps.
    proc = train_cli(
        "--preset",
        "nano",
        "--max-steps",
        3,
        "--data",
        corpus_file,
        "--out",
        out,
        "--set",
        "threads=1",
        env=subprocess_env(),
    )
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert "validation loss" in stdout and "perplexity" in stdout
    assert "KV cache (bf16): 512 bytes/token" in stdout and "MHA of this shape: 1,024 bytes/token" in stdout
    model = FusedKVForCausalLM.from_pretrained(out / "final")
    tok = AutoTokenizer.from_pretrained(out / "final")
    assert len(tok) == model.config.vocab_size == 512
    assert list(Path(os.environ["FUSEDKV_DATA_DIR"]).glob("small.txt-*-v512/meta.json"))  # the shared cache

    # --resume needs only --out: the saved settings come back (here: extended to 4 steps).
    first = json.loads((out / "summary.json").read_text())["curve"]
    assert command.main(["--out", str(out), "--resume", "--max-steps", "4", "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["curve"][:3] == first
    # Changing what defines the run on resume is refused.
    assert command.main(["--out", str(out), "--resume", "--set", "seed=5", "--quiet"]) == 2
    assert "seed" in capsys.readouterr().err

    # Continued training at a longer context with a new RoPE base (paper App. A.7).
    longer = tmp_path / "runs" / "long"
    rc = command.main(
        [
            "--init-from",
            str(out / "final"),
            "--rope-base",
            "50000",
            "--set",
            "seq_len=128",
            "--preset",
            "nano",
            "--max-steps",
            "2",
            "--data",
            str(corpus_file),
            "--out",
            str(longer),
            "--quiet",
            "--set",
            "threads=1",
        ]
    )
    assert rc == 0
    m2 = FusedKVForCausalLM.from_pretrained(longer / "final")
    assert m2.config.rope_theta == 50000 and m2.config.max_position_embeddings == 128
    assert AutoTokenizer.from_pretrained(longer / "final").get_vocab() == tok.get_vocab()


def test_missing_data_is_a_clear_error(tmp_path, capsys):
    rc = command.main(
        ["--preset", "nano", "--data", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "run")]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "fusedkv train: error:" in err and "does not exist" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


@pytest.mark.manual
def test_default_tiny_run_short(tmp_path):
    """`fusedkv train` exactly as a user runs it (tiny preset, built-in corpus), cut to 3 steps."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fusedkv.train.command",
            "--max-steps",
            "3",
            "--out",
            str(tmp_path / "tiny-fusedkv"),
        ],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    FusedKVForCausalLM.from_pretrained(tmp_path / "tiny-fusedkv" / "final")
    AutoTokenizer.from_pretrained(tmp_path / "tiny-fusedkv" / "final")
