"""train(cfg) in-process on the nano preset: outputs, re-entrancy, exact resume, divergence, bad input."""

from __future__ import annotations

import hashlib
import math
import re
import signal

import pytest
import torch
from train_helpers import nano_config
from transformers import AutoTokenizer

from fusedkv import FusedKVForCausalLM
from fusedkv.train import TrainingDiverged, train
from fusedkv.train import trainer as trainer_mod


def _snapshot(root):
    """Path -> (size, sha256) of every file below root: to prove nothing was touched."""
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.mark.slow
def test_nano_run_outputs_and_reentrancy(tmp_path, nano_data, capsys):
    before = signal.getsignal(signal.SIGINT)
    res = train(nano_config(tmp_path / "fkv", nano_data))
    assert capsys.readouterr().out == ""  # progress=False is quiet
    assert res["steps"] == 8 and res["tokens_seen"] == 8 * 512 and res["stopped"] is None
    assert math.isfinite(res["val_loss"]) and res["val_ppl"] == pytest.approx(math.exp(res["val_loss"]))
    assert res["val_loss"] < math.log(512)  # learnt something in 8 steps
    assert res["tokens_per_s"] > 0 and res["num_params"] > 0
    assert [r["step"] for r in res["curve"]] == list(range(1, 9))
    assert [r["step"] for r in res["val_curve"]] == [4, 8]
    # nano: 4 layers, 4 KV heads of 16 channels; FusedKV stores 2 layers' K and V in bf16.
    assert res["kv_cache_bytes_per_token"] == 2 * 2 * 4 * 16 * 2
    assert res["kv_cache_bytes_per_token_vanilla"] == 2 * 4 * 4 * 16 * 2 and res["kv_cache_ratio"] == 0.5
    assert res["kv_cache_bytes_full_context"] == res["kv_cache_bytes_per_token"] * 64

    out = tmp_path / "fkv"
    rows = (out / "metrics.csv").read_text().strip().splitlines()
    assert rows[0].startswith("step,tokens,loss,lr") and len(rows) == 9
    assert list((out / "tb").glob("events.out.tfevents.*"))
    assert (out / "learning_curves.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "summary.json").is_file()

    model = FusedKVForCausalLM.from_pretrained(out / "final")
    tok = AutoTokenizer.from_pretrained(out / "final")
    assert model.config.kv_sharing == "fusedkv" and len(tok) == model.config.vocab_size == 512
    assert model.config.eos_token_id == tok.eos_token_id
    ids = torch.tensor([tok.encode("To be, or not to be")])
    assert model(ids, use_cache=False).logits.shape == (1, ids.shape[1], 512)

    # Called again in the same process (another plan): independent, and signal handlers restored.
    res2 = train(nano_config(tmp_path / "van", nano_data, kv_sharing="vanilla"))
    assert res2["kv_cache_ratio"] == 1.0 and res2["plan"] == "vanilla"
    assert signal.getsignal(signal.SIGINT) is before


def _stop_with_signal_at(monkeypatch, call: int, sig=signal.SIGINT):
    """Make the `call`-th loss computation deliver `sig` to this process (like Ctrl-C mid-step)."""
    real, n = trainer_mod.compute_loss, [0]

    def loss(*a, **k):
        n[0] += 1
        if n[0] == call:
            signal.raise_signal(sig)
        return real(*a, **k)

    monkeypatch.setattr(trainer_mod, "compute_loss", loss)


@pytest.mark.slow
def test_signal_saves_and_resume_is_exact(tmp_path, nano_data, monkeypatch):
    ref = train(nano_config(tmp_path / "ref", nano_data))
    _stop_with_signal_at(monkeypatch, call=2 * 3 + 1)  # during step 4 (2 micro-batches per step)
    stopped = train(nano_config(tmp_path / "run", nano_data, ckpt_every=100))
    monkeypatch.undo()
    assert stopped["stopped"] == "SIGINT" and stopped["steps"] == 4 and stopped["checkpoint"] is None
    assert stopped["train_checkpoint"].endswith("step-00000004")  # saved on the signal, not by schedule
    assert not (tmp_path / "run" / "final").exists()
    resumed = train(nano_config(tmp_path / "run", nano_data, ckpt_every=100, resume=True))
    assert resumed["curve"] == ref["curve"]  # step, tokens, loss and learning rate, exactly
    assert resumed["val_loss"] == ref["val_loss"]
    a = FusedKVForCausalLM.from_pretrained(tmp_path / "ref" / "final").state_dict()
    b = FusedKVForCausalLM.from_pretrained(tmp_path / "run" / "final").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_non_finite_loss_stops_and_keeps_last_checkpoint(tmp_path, nano_data, monkeypatch):
    real, n = trainer_mod.compute_loss, [0]

    def loss(*a, **k):
        n[0] += 1
        out = real(*a, **k)
        return out * float("nan") if n[0] > 2 * 5 else out  # step 6 goes NaN

    monkeypatch.setattr(trainer_mod, "compute_loss", loss)
    out = tmp_path / "run"
    with pytest.raises(TrainingDiverged, match=r"step 6.*not finite.*step-00000004"):
        train(nano_config(out, nano_data, ckpt_every=2))
    snap = _snapshot(out / "checkpoints")
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step-00000002", "step-00000004"]
    assert not (out / "final").exists()
    monkeypatch.undo()
    # The kept checkpoint is good: resuming from it works and leaves the old files alone until pruning.
    res = train(nano_config(out, nano_data, ckpt_every=2, max_steps=6, resume=True))
    assert res["steps"] == 6 and all(math.isfinite(r["loss"]) for r in res["curve"])
    assert snap  # (the old checkpoints were pruned by the new ones, as configured)


def test_bad_inputs_fail_before_writing(tmp_path, nano_data, corpus_file):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="does not exist"):
        train(nano_config(out, tmp_path / "no" / "such.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n\n  ")
    with pytest.raises(ValueError, match="no non-empty documents"):
        train(nano_config(out, empty, data_dir=str(tmp_path / "d")))
    with pytest.raises(ValueError, match="vocabulary of 512 tokens but the model's vocab_size is 480"):
        train(nano_config(out, nano_data, vocab_size=480))
    with pytest.raises(ValueError, match="vocabulary of 512 tokens but the model's vocab_size is 256"):
        train(nano_config(out, corpus_file, vocab_size=256, tokenizer=str(nano_data / "tokenizer")))
    assert not out.exists()


@pytest.mark.slow
def test_existing_run_and_corrupt_checkpoint_are_refused(tmp_path, nano_data, capsys):
    out = tmp_path / "run"
    train(nano_config(out, nano_data, max_steps=4, ckpt_every=2))
    snap = _snapshot(out)
    with pytest.raises(ValueError, match="already holds a training run"):
        train(nano_config(out, nano_data, max_steps=4))
    assert _snapshot(out) == snap
    with pytest.raises(ValueError, match="already finished.*step 4 of 4"):
        train(nano_config(out, nano_data, max_steps=4, resume=True))
    ckpt = out / "checkpoints" / "step-00000004" / "model.safetensors"
    ckpt.write_bytes(ckpt.read_bytes()[:-100])  # truncated
    snap = _snapshot(out)
    # The newest checkpoint is corrupt: resume falls back to the previous one, with a warning (here
    # it then refuses the changed lr, so nothing is written).
    capsys.readouterr()
    with pytest.raises(ValueError, match="cannot resume.*lr"):
        train(nano_config(out, nano_data, lr=1.0, max_steps=8, resume=True))
    assert re.search(r"warning: .*corrupt.*model.safetensors.*resuming from .*step-00000002", capsys.readouterr().err)
    assert _snapshot(out) == snap
    with pytest.raises(ValueError, match=r"step-00000004 is corrupt.*model.safetensors"):  # asked for by name
        train(nano_config(out, nano_data, max_steps=8, resume=str(out / "checkpoints" / "step-00000004")))
    assert _snapshot(out) == snap


@pytest.mark.slow
def test_init_from_with_new_rope_base_and_context(tmp_path, nano_data):
    first = train(nano_config(tmp_path / "a", nano_data))
    res = train(
        nano_config(
            tmp_path / "b",
            nano_data,
            init_from=first["checkpoint"],
            rope_theta=50_000,
            seq_len=128,
            max_steps=2,
        )
    )
    model = FusedKVForCausalLM.from_pretrained(res["checkpoint"])
    assert model.config.rope_theta == 50_000 and model.config.max_position_embeddings == 128
    assert model.config.kv_sharing == "fusedkv" and res["context_length"] == 128
    # It started from trained weights, not from scratch (a fresh model starts near ln 512 = 6.24).
    assert res["curve"][0]["loss"] < first["curve"][0]["loss"] - 0.2
    with pytest.raises(ValueError, match="holds a 'fusedkv' model"):
        train(nano_config(tmp_path / "c", nano_data, init_from=first["checkpoint"], kv_sharing="vanilla"))
    with pytest.raises(ValueError, match="model.hidden_size: cannot change"):
        train(
            nano_config(tmp_path / "c", nano_data, init_from=first["checkpoint"], model={"hidden_size": 32})
        )


@pytest.mark.slow
def test_activation_checkpointing_gives_the_same_steps(tmp_path, nano_data):
    plain = train(nano_config(tmp_path / "a", nano_data, max_steps=2))
    ckpt = train(nano_config(tmp_path / "b", nano_data, max_steps=2, grad_checkpointing=True))
    assert [r["loss"] for r in ckpt["curve"]] == pytest.approx([r["loss"] for r in plain["curve"]], abs=1e-6)
    a = FusedKVForCausalLM.from_pretrained(tmp_path / "a" / "final").state_dict()
    b = FusedKVForCausalLM.from_pretrained(tmp_path / "b" / "final").state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


@pytest.mark.manual
def test_compile_runs(tmp_path, nano_data):
    res = train(nano_config(tmp_path / "c", nano_data, max_steps=2, compile=True))
    assert math.isfinite(res["val_loss"])


@pytest.mark.slow
def test_checkpoint_written_before_the_field_rename_still_resumes(tmp_path, nano_data):
    """Checkpoints saved before `plan`/`rope_base` became `kv_sharing`/`rope_theta` keep resuming."""
    import json

    from fusedkv.model_dirs import write_manifest
    from fusedkv.train import full_checkpoint as ck

    out = tmp_path / "old"
    train(nano_config(out, nano_data, max_steps=4, ckpt_every=2, kv_sharing="yoco"))
    for c in ck.list_checkpoints(out / "checkpoints"):  # rewrite the saved config the old way
        saved = json.loads((c / "train_config.json").read_text())
        saved["plan"], saved["rope_base"] = saved.pop("kv_sharing"), saved.pop("rope_theta")
        (c / "train_config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
        write_manifest(c, ck._FILES, step=int(c.name.split("-")[1]))
    (out / "final" / "manifest.json").unlink()  # final/ had no manifest then
    FusedKVForCausalLM.from_pretrained(out / "final")
    res = train(nano_config(out, nano_data, max_steps=6, ckpt_every=2, kv_sharing="yoco", resume=True))
    assert res["steps"] == 6 and res["plan"] == "yoco"
