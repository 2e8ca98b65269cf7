"""Distillation (`fusedkv train --distill-from`, `fusedkv uptrain`) with a teacher that does not share the
student's tokens (issue 27 #6), and `fusedkv uptrain`'s other bad inputs, through the real CLI: refused
with one line, before any data is prepared or anything is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.reliability.conftest import assert_one_line_error

VOCAB = 300


def _tokenizer(path: Path, text: str) -> None:
    """A byte-level BPE of VOCAB tokens trained on `text`, saved as transformers does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    assert tok.get_vocab_size() == VOCAB
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A vanilla teacher and its Lite conversion (tokenizer A), a vanilla teacher of the same vocabulary
    size with tokenizer B (other merges: the same ids are other strings), and one of VOCAB + 1 tokens."""
    from fusedkv.convert import convert_qwen3
    from fusedkv.data import read_builtin_text
    from tests.conftest import tiny_model

    root = tmp_path_factory.mktemp("distill-teachers")
    text = read_builtin_text(limit_chars=60_000)
    paths = {}
    for name, corpus, vocab in (("teacher", text[:30_000], VOCAB), ("other_tokenizer", text[30_000:], VOCAB),
                                ("other_vocab", text[:30_000], VOCAB + 1)):
        paths[name] = root / name
        _tokenizer(paths[name], corpus)
        tiny_model("vanilla", vocab_size=vocab, max_position_embeddings=64).save_pretrained(paths[name])
    paths["student"] = root / "student"
    convert_qwen3(paths["teacher"], paths["student"], kv_sharing="fusedkv-lite")
    (root / "corpus.txt").write_text(text)
    paths["corpus"] = root / "corpus.txt"
    return paths


def _train(cli, models, teacher: str, tmp_path: Path):
    data_cache = tmp_path / "data-cache"
    out = tmp_path / "run"
    result = cli("train", "--preset", "nano", "--init-from", models["student"], "--distill-from", models[teacher],
                 "--data", models["corpus"], "--out", out, "--max-steps", 1, "--set", "threads=1", "--quiet",
                 env={"FUSEDKV_DATA_DIR": str(data_cache)}, timeout=300)
    return result, out, data_cache


def test_a_teacher_with_another_tokenizer_is_refused_before_any_work(cli, models, tmp_path):
    result, out, data_cache = _train(cli, models, "other_tokenizer", tmp_path)
    line = assert_one_line_error(result, 2, "another tokenizer", str(models["other_tokenizer"]))
    assert "mean other strings" in line
    assert not out.exists() and not data_cache.exists()  # nothing tokenised, nothing written


def test_a_teacher_with_another_vocabulary_is_refused_before_any_work(cli, models, tmp_path):
    result, out, data_cache = _train(cli, models, "other_vocab", tmp_path)
    assert_one_line_error(result, 2, f"vocabulary of {VOCAB + 1} tokens", f"student {VOCAB}")
    assert not out.exists() and not data_cache.exists()


@pytest.mark.slow
def test_the_teacher_it_was_converted_from_is_accepted(cli, models, tmp_path):
    result, out, _ = _train(cli, models, "teacher", tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == 1


def test_uptrain_refuses_data_tokenised_by_another_tokenizer_before_converting(cli, models, tmp_path):
    """`fusedkv uptrain` reads the data as the teacher does: prepared data of another tokenizer is refused
    before the conversion starts."""
    from fusedkv.data import prepare_dataset

    other = tmp_path / "other-data"
    prepare_dataset(str(models["corpus"]), other, tokenizer=str(models["other_tokenizer"]), num_proc=1)
    out = tmp_path / "uptrain"
    result = cli("uptrain", models["teacher"], out, "--plan", "fusedkv", "--data", other, "--max-steps", 1,
                 "--quiet", timeout=300)
    assert_one_line_error(result, 2, "another tokenizer")
    assert not out.exists()


@pytest.fixture(scope="module")
def bad_sources(models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad-sources")
    bare = root / "no-tokenizer"  # the teacher's model without its tokenizer
    bare.mkdir()
    for f in models["teacher"].iterdir():
        if f.suffix in (".json", ".safetensors") and not f.name.startswith(("tokenizer", "special")):
            (bare / f.name).write_bytes(f.read_bytes())
    gpt2 = root / "gpt2"  # a family fusedkv does not import
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": VOCAB}))
    (gpt2 / "model.safetensors").write_bytes((models["teacher"] / "model.safetensors").read_bytes())
    return {"no-tokenizer": bare, "gpt2": gpt2, "missing": root / "missing"}


@pytest.mark.parametrize("case, fragment", [
    ("missing", "does not exist"),
    ("no-tokenizer", "has no tokenizer"),
    ("gpt2", "'gpt2'"),
    ("--plan no-such-plan", "no-such-plan"),
    ("--plan vanilla", "already is a full-cache model"),
    ("--data no-such-data.txt", "no-such-data.txt"),
    ("OUT holding SRC", "would hold the source"),
    ("--set lr=-1", "lr"),
])
def test_uptrain_bad_input_is_one_line_before_any_work(cli, models, bad_sources, tmp_path, case, fragment):
    src, out, extra = models["teacher"], tmp_path / "out", []
    if case in bad_sources:
        src = bad_sources[case]
    elif case.startswith("--"):
        extra = case.split()
    else:  # --overwrite there would delete the source
        src = tmp_path / "models" / "teacher"
        shutil.copytree(models["teacher"], src)
        out = tmp_path / "models"
        extra = ["--overwrite"]
    before = sorted(p.name for p in out.iterdir()) if out.exists() else None
    result = cli("uptrain", src, out, "--data", models["corpus"], "--preset", "nano", "--quiet", *extra,
                 env={"FUSEDKV_DATA_DIR": str(tmp_path / "data-cache")}, timeout=300)
    assert_one_line_error(result, 2, fragment)
    assert (sorted(p.name for p in out.iterdir()) if out.exists() else None) == before
    assert not (tmp_path / "data-cache").exists()


def test_uptrain_does_not_continue_a_run_with_other_settings(cli, models, tmp_path):
    """An OUT holding an uptraining run of another plan is neither continued nor overwritten without
    --overwrite; an OUT holding other files is refused too."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "uptrain.json").write_text(json.dumps({"src": str(models["teacher"].resolve()), "plan": "fusedkv-lite",
                                                  "fusion_init": "equivalent", "train": {}}))
    (out / "converted").mkdir()  # the run made something (settings alone are no run: issue 41, defect 9)
    (out / "converted" / "config.json").write_text("{}")
    result = cli("uptrain", models["teacher"], out, "--plan", "fusedkv", "--data", models["corpus"], "--preset",
                 "nano", "--quiet", timeout=300)
    assert_one_line_error(result, 2, "other settings", "plan: was 'fusedkv-lite', now 'fusedkv'", "--overwrite")
    assert sorted(p.name for p in out.iterdir()) == ["converted", "uptrain.json"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    result = cli("uptrain", models["teacher"], other, "--data", models["corpus"], "--preset", "nano", "--quiet",
                 timeout=300)
    assert_one_line_error(result, 2, "not an uptraining run")
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]
