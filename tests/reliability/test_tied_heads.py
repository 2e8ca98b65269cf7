"""Every saved model round-trips its output head exactly: tied (one tensor under two names, as SmolLM2, Gemma
and Qwen3-0.6B ship) stays one tensor after loading, untied stays two, and every value is bit for bit the
one saved. Checked for each way a model is saved: a full training checkpoint, a sharded (DCP) one, and the
final model directory; then through `fusedkv train` (a checkpoint mid-run, a resume, the same weights as an
uninterrupted run). Issue 41, defect 4: uptraining a tied model failed at its first checkpoint ("Some tensors
share memory"); tests/uptrain/test_uptrain.py kills and resumes the uptraining of a tied Qwen3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fusedkv import FusedKVForCausalLM
from fusedkv.train import full_checkpoint as ckpt_io
from fusedkv.train import sharded_checkpoint as dcp_io
from tests.conftest import tiny_model

REPO = Path(__file__).resolve().parents[2]
TIES = [pytest.param(True, id="tied"), pytest.param(False, id="untied")]


def _model(tied: bool) -> FusedKVForCausalLM:
    model = tiny_model("fusedkv", tie_word_embeddings=tied).train()
    if not tied:  # untied but equal values: a loader that ties by value, not by identity, would be caught
        with torch.no_grad():
            model.lm_head.weight.copy_(model.model.embed_tokens.weight)
            model.lm_head.weight[0, 0] += 1.0  # and one value apart, which a tying loader would lose
    return model


def _is_tied(model) -> bool:
    return model.lm_head.weight is model.model.embed_tokens.weight


def _assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert _is_tied(a) == _is_tied(b)


def _optimizer(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(32).reshape(2, 16) % model.config.vocab_size
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()  # a step: the optimiser has state, and a tied head moved as one tensor
    return opt


@pytest.mark.parametrize("tied", TIES)
def test_full_checkpoint_round_trips_the_head(tied, tmp_path):
    model = _model(tied)
    assert _is_tied(model) == tied
    opt = _optimizer(model)
    from fusedkv.train import distributed as D

    sd, osd = D.full_model_state_dict(model), D.full_optimizer_state_dict(model, opt)
    path = ckpt_io.save_checkpoint(tmp_path / "checkpoints", 1, sd, osd, {"step": 1}, {}, model.config.to_dict())
    ckpt = ckpt_io.load_checkpoint(path)
    fresh = FusedKVForCausalLM(model.config)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    D.load_full_state(fresh, fresh_opt, ckpt["model"], ckpt["optimizer"])
    _assert_same(model, fresh)
    assert _is_tied(fresh) == tied
    # the optimiser's moments came back too, for the head as for every other weight
    a, b = D.full_optimizer_state_dict(model, opt), D.full_optimizer_state_dict(fresh, fresh_opt)
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a["state"][k][name], b["state"][k][name]), (k, name)
    # the file holds each tensor once: a tied head is not written twice
    stored = load_file(str(path / "model.safetensors"))
    assert ("lm_head.weight" in stored) == (not tied)


@pytest.mark.parametrize("tied", TIES)
def test_sharded_checkpoint_round_trips_the_head(tied, tmp_path):
    model = _model(tied)
    opt = _optimizer(model)
    saver = dcp_io.ShardedCheckpointer(tmp_path / "checkpoints", async_save=False)
    try:
        path = saver.save(1, model, opt, {"step": 1}, {"rng": None}, {}, model.config.to_dict())
    finally:
        saver.close()
    fresh = FusedKVForCausalLM(model.config)
    dcp_io.load_into(path, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    _assert_same(model, fresh)
    assert _is_tied(fresh) == tied


@pytest.mark.parametrize("tied", TIES)
def test_final_model_directory_round_trips_the_head(tied, tmp_path):
    model = _model(tied)
    model.save_pretrained(tmp_path / "final")
    assert json.loads((tmp_path / "final" / "config.json").read_text())["tie_word_embeddings"] is tied
    _assert_same(model, FusedKVForCausalLM.from_pretrained(tmp_path / "final"))


# ---- through the commands ---------------------------------------------------------------------------------
def _train(out: Path, data: Path, steps: int, tied: bool, fmt: str, resume=False) -> dict:
    from fusedkv.train import train
    from tests.train.train_helpers import nano_config

    return train(nano_config(out, data, max_steps=steps, ckpt_every=1, eval_every=100, final_eval_batches=1,
                             checkpoint_format=fmt, resume=resume, model={"tie_word_embeddings": tied}))


def _final_weights(out: Path) -> dict:
    return load_file(str(out / "final" / "model.safetensors"))


def test_train_cli_saves_a_tied_model_mid_run(tmp_path, data, cli):
    """The defect as a user met it: a tied model's first mid-training checkpoint (was exit 1, internal error)."""
    out = tmp_path / "run"
    r = cli("train", "--preset", "nano", "--data", data, "--out", out, "--max-steps", "2", "--quiet",
            "--set", "ckpt_every=1", "--set", "threads=1", "--set", "eval_every=100", "--set", "final_eval_batches=1",
            "--set", "model.tie_word_embeddings=true", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000001", "step-00000002"]
    assert _is_tied(FusedKVForCausalLM.from_pretrained(out / "final"))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_train_resumed_from_a_mid_run_checkpoint_equals_the_uninterrupted_run(fmt, tmp_path, data):
    """3 steps straight; then the run resumed from its step-2 checkpoint (as after a kill) ends with the same
    weights, bit for bit, and the head still tied (untied: tests/train/test_interrupt.py, test_dcp_resume.py)."""
    out, tied = tmp_path / "run", True
    _train(out, data, 3, tied, fmt)
    straight = _final_weights(out)
    assert ("lm_head.weight" in straight) == (not tied)  # save_pretrained writes a tied head once
    _train(out, data, 3, tied, fmt, resume=str(out / "checkpoints" / "step-00000002"))
    resumed = _final_weights(out)
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert _is_tied(FusedKVForCausalLM.from_pretrained(out / "final")) == tied
