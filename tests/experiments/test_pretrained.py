"""`fusedkv compare` on a pretrained model (an experiment file with `source:`): KV cache kinds and uptrained
half-cache models scored on held-out text, cached row by row, runnable in pieces."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import yaml

from fusedkv.experiments import pretrained
from tests import _cli as cli_process

REPO = Path(__file__).resolve().parents[2]
VOCAB = 320


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny transformers Llama with a tokenizer, and a held-out text."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fusedkv.data import read_builtin_text
    from fusedkv.data.tokenizer import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("pretrained")
    text = read_builtin_text(limit_chars=60_000)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128))
    train_bpe_tokenizer([text], VOCAB, root / "tok")
    model.save_pretrained(root / "llama")
    for f in (root / "tok").iterdir():
        (root / "llama" / f.name).write_bytes(f.read_bytes())
    (root / "heldout.txt").write_text(text[-20_000:])
    return root / "llama", root / "heldout.txt"


def _spec(tmp_path: Path, src: Path, text: Path, rows: list[dict], models=None) -> Path:
    spec = dict(name="tiny", description="tiny pretrained", source=str(src), texts=[str(text)], window=32,
                windows=3, models=models or [{"name": "teacher"}], rows=rows)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _compare(tmp_path, *args):
    return cli_process.fusedkv("compare", *map(str, args), cwd=REPO, env={"OMP_NUM_THREADS": "1",
                                                                           "TOKENIZERS_PARALLELISM": "false"})


def test_cache_rows_table_plot_and_reuse(tmp_path, source):
    src, text = source
    rows = [{"model": "teacher", "cache": c} for c in ("f32", "bf16", "fp8")]
    spec = _spec(tmp_path, src, text, rows)
    out = tmp_path / "out"
    proc = _compare(tmp_path, spec, "--out", out)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = {r["cache"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    ppl = {c: r["ppl"][str(text)] for c, r in results.items()}
    assert all(math.isfinite(p) and p > 1 for p in ppl.values())
    assert ppl["bf16"] == pytest.approx(ppl["f32"], rel=1e-2) and ppl["fp8"] != ppl["f32"]
    # bytes per token: 4 layers x 2 KV heads x 16 dims x (K, V)
    assert [results[c]["kv_bytes_per_token"] for c in ("f32", "bf16", "fp8")] == [1024, 512, 256]
    assert "| teacher fp8 | vanilla | fp8 | 256 | 50.0 |" in (out / "results.md").read_text()
    # The local lm-eval tasks: once per model, on its unquantised rows.
    from fusedkv.eval.harness import LOCAL_TASKS

    assert set(results["f32"]["tasks"]) == set(LOCAL_TASKS) and results["bf16"]["tasks"] == results["f32"]["tasks"]
    assert "tasks" not in results["fp8"] and len(list((out / "tasks").iterdir())) == 1
    # Each window's loss is kept (their mean is the text's), and the ratio column carries its paired interval.
    fp8 = results["fp8"]
    windows = fp8["window_loss"][str(text)]
    assert len(windows) > 1 and sum(windows) / len(windows) == pytest.approx(fp8["loss"][str(text)], rel=1e-6)
    fp8_line = next(line for line in (out / "results.md").read_text().splitlines() if line.startswith("| teacher fp8"))
    assert re.search(r"\| \d\.\d{3} \[\d\.\d\d, \d\.\d\d\] \|", fp8_line), fp8_line
    assert (out / "quality_vs_bytes.png").stat().st_size > 5_000
    # A second run scores nothing again; --runs runs a piece; --finished-only trains and scores nothing.
    stamp = {p.name: p.stat().st_mtime_ns for p in (out / "rows").iterdir()}
    again = _compare(tmp_path, spec, "--out", out, "--runs", "teacher fp8")
    assert again.returncode == 0 and "teacher fp8" in again.stdout and "teacher bf16" not in again.stdout
    assert {p.name: p.stat().st_mtime_ns for p in (out / "rows").iterdir()} == stamp
    more = _spec(tmp_path, src, text, rows + [{"model": "teacher", "cache": "kivi4"}])
    listed = _compare(tmp_path, more, "--out", out, "--finished-only")
    assert listed.returncode == 0 and "not finished: teacher kivi4" in listed.stdout


def test_bad_files_are_one_line(tmp_path, source):
    src, text = source
    bad = _spec(tmp_path, src, text, [{"model": "nope", "cache": "bf16"}])
    proc = _compare(tmp_path, bad, "--out", tmp_path / "o")
    assert proc.returncode == 2 and "reads model 'nope'" in proc.stderr
    bad = _spec(tmp_path, src, text, [{"model": "teacher", "cache": "int3"}])
    proc = _compare(tmp_path, bad, "--out", tmp_path / "o")
    assert proc.returncode == 2 and "cache must be one of" in proc.stderr
    proc = _compare(tmp_path, _spec(tmp_path, src, text, [{"model": "teacher", "cache": "f32"}]), "--out",
                    tmp_path / "o", "--source", tmp_path / "missing.gguf")
    assert proc.returncode == 2 and "no such file" in proc.stderr


def test_kv_bytes_per_token_kivi_counts_codes_and_group_metadata():
    from fusedkv import FusedKVConfig

    cfg = FusedKVConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=64, vocab_size=97, kv_sharing="fusedkv")
    # 2 storage layers x 2 heads x (K, V) x 64 dims x (4 bits + a 16-bit scale and zero per 32 elements)
    assert pretrained.kv_bytes_per_token(cfg, "kivi4") == 2 * 2 * 2 * 64 * (0.5 + 4 / 32)
    assert pretrained.kv_bytes_per_token(cfg, "bf16") == 2 * 2 * 2 * 64 * 2


@pytest.mark.slow
def test_uptrained_model_row_resumes_through_uptrain(tmp_path, source):
    """A half-cache model is made by `fusedkv uptrain` (2 steps) and scored; its recovery curve is drawn."""
    src, text = source
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text.read_text())
    models = [{"name": "teacher"}, {"name": "lite", "plan": "fusedkv-lite", "data": str(corpus), "max_steps": 2,
                                    "args": ["--preset", "nano"], "set": {"threads": 1, "eval_every": 1,
                                                                         "final_eval_batches": 2, "warmup_steps": 1}}]
    spec = _spec(tmp_path, src, text, [{"model": "teacher", "cache": "bf16"}, {"model": "lite", "cache": "bf16"}],
                 models)
    out = tmp_path / "out"
    proc = _compare(tmp_path, spec, "--out", out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["model"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert rows["lite"]["plan"] == "fusedkv-lite" and rows["lite"]["kv_bytes_per_token"] == 256
    assert len(rows["lite"]["curve"]) >= 2 and (out / "recovery.png").is_file()
    assert (out / "models" / "lite" / "report.json").is_file()


def test_the_shipped_smollm2_experiment_is_valid():
    from fusedkv.experiments.spec import load_experiment

    spec = load_experiment("smollm2")
    pretrained.check(spec, "smollm2")
    assert pretrained.is_pretrained(spec) and spec["source"].endswith(".gguf")
    models = {m["name"]: m for m in spec["models"]}
    assert models["fusedkv-calibrated"]["train"] is False and "train" not in models["fusedkv-uptrained"]
    cmd = pretrained.uptrain_command(Path("src"), models["lite-uptrained"], Path("out"))
    assert cmd[cmd.index("--plan") + 1] == "fusedkv-lite" and "--calib-data" in cmd and "seq_len=512" in cmd


def test_paired_interval_is_the_ratio_when_every_window_moves_alike():
    from fusedkv.experiments.pretrained_report import paired_interval

    ref = [2.0, 3.5, 2.7, 4.1]
    assert paired_interval(ref, ref) == pytest.approx((1.0, 1.0))
    assert paired_interval([x + 0.1 for x in ref], ref) == pytest.approx((math.exp(0.1),) * 2)
    lo, hi = paired_interval([2.1, 3.4, 2.9, 4.1], ref)
    assert lo < math.exp((0.1 - 0.1 + 0.2 + 0.0) / 4) < hi and lo < 1 < hi
