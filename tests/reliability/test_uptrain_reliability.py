"""`fusedkv uptrain` on bad input, through the real CLI (issue 41, defects 1, 9, 10, 11).

Every check that reads only the inputs (the source exists and is a model, the data has text enough for a
validation window, seq_len fits the source's context, the batch splits into micro-batches) runs before OUT
is written; `--overwrite` replaces a finished run only once the new one is known to start (its data is
ready and its source converted, as `fusedkv train --overwrite` waits for its model); a run that failed
before producing anything does not block the corrected command; the same run given by an absolute path is
the same run."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.reliability.conftest import _save_tokenizer, assert_one_line_error

RECIPE = ("--preset", "nano", "--plan", "fusedkv", "--max-steps", "1", "--quiet", "--set", "threads=1",
          "--set", "final_eval_batches=1", "--set", "eval_every=100")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama with its tokenizer (context 128), the same lacking one weight (only the conversion reads
    the tensors), a corpus, an empty file, a text too short for one validation window."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fusedkv.data import read_builtin_text

    root = tmp_path_factory.mktemp("uptrain-inputs")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128))
    model.save_pretrained(root / "llama")
    _save_tokenizer(root / "llama", 300)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "model.layers.3.mlp.down_proj.weight"}
    (root / "broken-llama").mkdir()
    save_file(state, str(root / "broken-llama" / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (root / "broken-llama" / name).write_bytes((root / "llama" / name).read_bytes())
    (root / "corpus.txt").write_text(read_builtin_text(limit_chars=40_000))
    (root / "empty.txt").write_text("")
    (root / "short.txt").write_text("ROMEO: what light.\n" * 3)
    return {p.name: p for p in root.iterdir()}


def _env(tmp_path: Path) -> dict:
    return {"FUSEDKV_DATA_DIR": str(tmp_path / "data-cache")}


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"}


def _previous_run(out: Path) -> dict:
    """An OUT as a finished uptraining run leaves it (the files the pipeline writes, small stand-ins)."""
    for name in ("converted/config.json", "converted/model.safetensors", "train/final/model.safetensors",
                 "train/checkpoints/step-00000001/manifest.json", "train/summary.json", "eval/after.json",
                 "report.md", "report.json", "curves.png", "uptrain.json"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(json.dumps({"file": name}))
    return _snapshot(out)


BAD = [  # (extra args, data file, what the one-line error names)
    pytest.param((), "empty.txt", "no non-empty documents", id="empty-data"),
    pytest.param((), "short.txt", "fewer than seq_len + 1", id="too-little-data"),
    pytest.param(("--set", "micro_batch_size=3"), "corpus.txt", "micro_batch_size=3", id="batch-split"),
    pytest.param(("--set", "seq_len=256", "--set", "global_batch_tokens=2048"), "corpus.txt", "past the context",
                 id="past-the-context"),
]


@pytest.mark.parametrize("extra,data,fragment", BAD)
def test_bad_input_is_refused_before_out_is_written(cli, inputs, tmp_path, extra, data, fragment):
    out = tmp_path / "run"
    r = cli("uptrain", inputs["llama"], out, "--data", inputs[data], *RECIPE, *extra, env=_env(tmp_path),
            timeout=300)
    assert_one_line_error(r, 2, fragment)
    assert not out.exists(), sorted(p.name for p in out.iterdir())


@pytest.mark.parametrize("extra,data,fragment", BAD)
def test_overwrite_with_bad_input_keeps_the_finished_run(cli, inputs, tmp_path, extra, data, fragment):
    """Defect 1: `--overwrite` with settings that then fail deleted the finished run in OUT."""
    out = tmp_path / "run"
    before = _previous_run(out)
    r = cli("uptrain", inputs["llama"], out, "--data", inputs[data], *RECIPE, *extra, "--overwrite",
            env=_env(tmp_path), timeout=300)
    assert_one_line_error(r, 2, fragment)
    assert _snapshot(out) == before


def test_overwrite_keeps_the_finished_run_when_the_conversion_fails(cli, inputs, tmp_path):
    """A source that only the conversion can find wrong (a weight is missing): the old run stays whole, and
    nothing of the failed conversion is left beside it."""
    out = tmp_path / "run"
    before = _previous_run(out)
    r = cli("uptrain", inputs["broken-llama"], out, "--data", inputs["corpus.txt"], *RECIPE, "--overwrite",
            env=_env(tmp_path), timeout=300)
    assert_one_line_error(r, 2, "lacks weights")
    assert _snapshot(out) == before
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".lock"]


def test_a_run_that_produced_nothing_does_not_block_the_corrected_command(cli, inputs, tmp_path):
    """Defect 9: a failed first attempt left OUT half-made and the corrected command was refused as 'other
    settings'. A failure before anything is made leaves nothing to protect: another setting is accepted."""
    out = tmp_path / "run"
    r = cli("uptrain", inputs["broken-llama"], out, "--data", inputs["corpus.txt"], *RECIPE, env=_env(tmp_path),
            timeout=300)
    assert_one_line_error(r, 2, "lacks weights")
    r = cli("uptrain", inputs["broken-llama"], out, "--data", inputs["corpus.txt"], *RECIPE, "--set", "lr=1e-4",
            env=_env(tmp_path), timeout=300)
    assert_one_line_error(r, 2, "lacks weights")  # the same conversion error, not "other settings"


def test_missing_source_says_it_does_not_exist(cli, inputs, tmp_path):
    r = cli("uptrain", "nope", tmp_path / "run", *RECIPE, env=_env(tmp_path), cwd=tmp_path)
    assert_one_line_error(r, 2, "nope", "does not exist")
    assert not (tmp_path / "run").exists()


def test_the_same_run_by_an_absolute_path_is_the_same_run(inputs, tmp_path, monkeypatch):
    """Defect 10: the settings check compared raw path strings; a relative and an absolute SRC, OUT and
    --data name the same run. Another source is still another run."""
    import argparse

    from fusedkv.uptrain import command, pipeline

    parser = command.add_arguments(argparse.ArgumentParser())
    monkeypatch.chdir(inputs["llama"].parent)
    monkeypatch.setenv("FUSEDKV_DATA_DIR", str(tmp_path / "data-cache"))
    out = tmp_path / "run"

    def run(src, data, out_arg):
        return command.build(parser.parse_args([str(src), str(out_arg), "--data", str(data), *RECIPE]))

    first = run("llama", "corpus.txt", out)
    (out / "converted").mkdir(parents=True)
    (out / "converted" / "config.json").write_text("{}")
    (out / pipeline.SETTINGS).write_text(json.dumps(first.settings()))
    monkeypatch.chdir(tmp_path)
    pipeline.check(run(inputs["llama"], inputs["corpus.txt"], "run"), overwrite=False)
    with pytest.raises(ValueError, match="other settings"):
        pipeline.check(run(inputs["broken-llama"], inputs["corpus.txt"], "run"), overwrite=False)


@pytest.mark.slow
def test_overwrite_of_a_real_finished_run(cli, inputs, tmp_path):
    """A finished run survives a failing --overwrite untouched; the same run named by absolute paths has
    nothing left to do; a good --overwrite replaces it whole."""
    out = tmp_path / "run"
    args = ("--data", inputs["corpus.txt"], *RECIPE)
    r = cli("uptrain", inputs["llama"], out, *args, env=_env(tmp_path), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    before = _snapshot(out)
    assert {"report.json", "train/final/model.safetensors", "uptrain.json"} <= set(before)
    r = cli("uptrain", inputs["llama"], out, *args, "--overwrite", "--set", "micro_batch_size=3", env=_env(tmp_path),
            timeout=300)
    assert_one_line_error(r, 2, "micro_batch_size")
    assert _snapshot(out) == before
    # the same run, named relative to another directory: every stage done
    verbose = [a for a in RECIPE if a != "--quiet"]
    r = cli("uptrain", "llama", os.path.relpath(out, inputs["llama"].parent), "--data", "corpus.txt", *verbose,
            env=_env(tmp_path), cwd=inputs["llama"].parent, timeout=600)
    assert r.returncode == 0 and "train: done" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    r = cli("uptrain", inputs["llama"], out, *args, "--overwrite", "--plan", "fusedkv-lite", env=_env(tmp_path),
            timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "report.json").read_text())["plan"] == "fusedkv-lite"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) in ([], [".lock"])
