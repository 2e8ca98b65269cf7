"""Distillation for uptraining: the loss against a direct float64 computation, and the CLI path end to end
(pre-train vanilla -> fusedkv convert -> fusedkv train --init-from --distill-from)."""

from __future__ import annotations

import json

import pytest
import torch
from train_helpers import REPO, subprocess_env

from fusedkv.train.distill import distillation_loss
from tests import _cli as cli_process


def _direct(s, t, y, alpha, T, hs=(), ht=(), w=0.0):
    """The loss written out term by term, in float64."""
    s, t = s.double().flatten(0, 1), t.double().flatten(0, 1)
    p_t = torch.softmax(t / T, -1)
    log_p_s = torch.log_softmax(s / T, -1)
    kl = (p_t * (torch.log(p_t) - log_p_s)).sum(-1).mean() * T * T
    lm = -torch.log_softmax(s, -1).gather(1, y.flatten()[:, None]).mean()
    hidden = sum(((a.double() - b.double()) ** 2).mean() for a, b in list(zip(hs, ht))[1:]) / max(1, len(hs) - 1)
    return alpha * kl + (1 - alpha) * lm + w * hidden, kl, lm


@pytest.mark.parametrize("alpha,T,w", [(0.5, 1.0, 0.0), (0.3, 2.0, 0.0), (1.0, 0.5, 0.7), (0.0, 3.0, 0.0)])
def test_loss_matches_direct_computation(alpha, T, w):
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 5, 11, generator=g, dtype=torch.float64) * 3
    t = torch.randn(2, 5, 11, generator=g, dtype=torch.float64) * 3
    y = torch.randint(0, 11, (2, 5), generator=g)
    hs = [torch.randn(2, 5, 4, generator=g) for _ in range(3)]
    ht = [torch.randn(2, 5, 4, generator=g) for _ in range(3)]
    loss, parts = distillation_loss(s, t, y, alpha, T, hs, ht, w)
    ref, kl, lm = _direct(s, t, y, alpha, T, hs, ht, w)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    assert parts["kl"] == pytest.approx(float(kl), rel=1e-5) and parts["lm"] == pytest.approx(float(lm), rel=1e-5)


def test_kl_gradient_is_temperature_times_probability_gap():
    """d/ds [T^2 KL(p_t || softmax(s/T))] = T (softmax(s/T) - p_t), per token, divided by the token count."""
    g = torch.Generator().manual_seed(1)
    T = 2.0
    s = torch.randn(1, 3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(1, 3, 7, generator=g, dtype=torch.float64)
    loss, _ = distillation_loss(s, t, torch.zeros(1, 3, dtype=torch.long), alpha=1.0, temperature=T)
    loss.backward()
    expected = T * (torch.softmax(s.detach() / T, -1) - torch.softmax(t / T, -1)) / 3
    torch.testing.assert_close(s.grad, expected.to(s.grad.dtype), rtol=1e-4, atol=1e-6)


def test_identical_models_have_zero_kl_and_bad_settings_are_refused():
    x = torch.randn(2, 4, 9)
    y = torch.randint(0, 9, (2, 4))
    loss, parts = distillation_loss(x, x.clone(), y, alpha=1.0)
    assert abs(parts["kl"]) < 1e-6 and float(loss) == pytest.approx(parts["kl"], abs=1e-6)
    with pytest.raises(ValueError, match="distill_alpha"):
        distillation_loss(x, x, y, alpha=1.5)
    with pytest.raises(ValueError, match="distill_temperature"):
        distillation_loss(x, x, y, temperature=0)
    with pytest.raises(ValueError, match="same vocabulary"):
        distillation_loss(x, torch.randn(2, 4, 8), y)
    with pytest.raises(ValueError, match="hidden states"):
        distillation_loss(x, x, y, hidden_weight=1.0)


def test_masked_positions_count_in_no_term():
    """Issue 27 #10: positions whose label is IGNORE_INDEX (the context of a `loss=answers` mixture) count
    in the KL and hidden terms as little as in the CE term: the loss equals the loss over the counted
    positions alone, and the masked positions' logits get no gradient."""
    from fusedkv.model.loss import IGNORE_INDEX

    g = torch.Generator().manual_seed(2)
    s = torch.randn(2, 6, 13, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(2, 6, 13, generator=g, dtype=torch.float64) * 2
    y = torch.randint(0, 13, (2, 6), generator=g)
    y[0, :4] = IGNORE_INDEX  # context only
    y[1, 1] = IGNORE_INDEX
    hs = [torch.randn(2, 6, 5, generator=g, dtype=torch.float64) for _ in range(3)]
    ht = [torch.randn(2, 6, 5, generator=g, dtype=torch.float64) for _ in range(3)]
    loss, parts = distillation_loss(s, t, y, 0.6, 1.5, hs, ht, 0.3)
    keep = y != IGNORE_INDEX
    ref, kl, lm = _direct(s[keep][None], t[keep][None], y[keep][None], 0.6, 1.5, [h[keep][None] for h in hs],
                          [h[keep][None] for h in ht], 0.3)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    assert parts["kl"] == pytest.approx(float(kl.detach()), rel=1e-5)
    assert parts["lm"] == pytest.approx(float(lm.detach()), rel=1e-5)
    loss.backward()
    assert torch.all(s.grad[~keep] == 0) and torch.all(s.grad[keep].abs().sum(-1) > 0)
    # Every position masked: nothing to learn, every term 0 (as the CE term alone gives).
    none, parts = distillation_loss(s.detach(), t, torch.full_like(y, IGNORE_INDEX), 0.5, 1.0, hs, ht, 1.0)
    assert float(none) == 0.0 and parts == {"kl": 0.0, "lm": 0.0, "hidden": 0.0}


def _cli(*args, timeout=300):
    proc = cli_process.fusedkv(*args, cwd=REPO, env=subprocess_env(), timeout=timeout)
    assert proc.returncode == 0, f"fusedkv {' '.join(map(str, args))} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.slow
def test_uptraining_by_distillation_through_the_cli(tmp_path, nano_data):
    """vanilla nano run -> `fusedkv convert` to fusedkv-lite -> `fusedkv train --init-from --distill-from`."""
    common = ["--preset", "nano", "--set", f"data={nano_data}", "--set", "threads=1", "--set", "ckpt_every=0"]
    _cli("train", "--plan", "vanilla", "--out", tmp_path / "teacher", "--max-steps", 4, *common)
    teacher = tmp_path / "teacher" / "final"
    _cli("convert", teacher, tmp_path / "lite", "--kv-sharing", "fusedkv-lite")
    conv = json.loads((tmp_path / "lite" / "config.json").read_text())
    assert conv["kv_sharing"] == "fusedkv-lite"
    from safetensors.torch import load_file

    t_w, s_w = load_file(teacher / "model.safetensors"), load_file(tmp_path / "lite" / "model.safetensors")
    assert "model.layers.3.self_attn.k_proj.weight" in t_w and "model.layers.3.self_attn.k_proj.weight" not in s_w
    q = "model.layers.3.self_attn.q_proj.weight"
    torch.testing.assert_close(s_w[q], t_w[q])  # everything else is the teacher's
    out = _cli("train", "--init-from", tmp_path / "lite", "--distill-from", teacher, "--distill-alpha", 0.7,
               "--distill-temperature", 2.0, "--out", tmp_path / "student", "--max-steps", 2, *common)
    assert f"distilling from {teacher}" in out.stdout and "alpha 0.7" in out.stdout
    summary = json.loads((tmp_path / "student" / "summary.json").read_text())
    assert summary["plan"] == "fusedkv-lite" and summary["steps"] == 2 and summary["val_loss"] is not None


def test_distilling_from_a_missing_teacher_is_a_one_line_error(tmp_path, nano_data):
    proc = cli_process.fusedkv("train", "--preset", "nano", "--set", f"data={nano_data}", "--distill-from",
                               tmp_path / "nowhere", "--out", tmp_path / "run", cwd=REPO, env=subprocess_env(),
                               timeout=120)
    assert proc.returncode == 2 and "nowhere" in proc.stderr and "Traceback" not in proc.stderr


def test_distiller_with_hidden_states_on_real_models(tmp_path):
    """Distiller on FusedKV models: a student identical to its teacher has zero KL and zero hidden loss; a
    converted Lite student gets exactly distillation_loss of the two models' outputs."""
    from fusedkv import FusedKVConfig, FusedKVForCausalLM
    from fusedkv.convert import from_qwen3_state, fusedkv_to_plan_config
    from fusedkv.train.distill import Distiller

    torch.manual_seed(0)
    cfg = FusedKVConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=4, max_position_embeddings=32, kv_sharing="vanilla")
    teacher = FusedKVForCausalLM(cfg).eval()
    teacher.save_pretrained(tmp_path / "teacher")
    x = torch.randint(0, 64, (2, 16))
    y = torch.randint(0, 64, (2, 16))
    same = Distiller(str(tmp_path / "teacher"), cfg, "cpu", alpha=1.0, temperature=2.0, hidden_weight=1.0)
    loss = same(teacher, x, y)
    assert abs(float(loss.detach())) < 1e-5 and abs(same.last_parts["hidden"]) < 1e-10
    student = from_qwen3_state(teacher.state_dict(), fusedkv_to_plan_config(cfg.to_dict(), "fusedkv-lite")).eval()
    kd = Distiller(str(tmp_path / "teacher"), student.config, "cpu", alpha=0.3, temperature=1.5, hidden_weight=0.5)
    got = kd(student, x, y)
    with torch.no_grad():
        t = teacher(input_ids=x, output_hidden_states=True)
    s = student(input_ids=x, output_hidden_states=True)
    want, parts = distillation_loss(s.logits, t.logits, y, 0.3, 1.5, s.hidden_states, t.hidden_states, 0.5)
    torch.testing.assert_close(got, want)
    assert parts["kl"] > 1e-4 and parts["hidden"] > 0  # the conversion changed the upper layers' K/V
    got.backward()  # gradients reach the student only
    assert student.model.layers[3].self_attn.q_proj.weight.grad is not None
    assert all(p.grad is None for p in kd.teacher.parameters())


def _hf_teacher(kind: str, vocab: int):
    """A tiny random transformers Qwen3 or Qwen3-MoE model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, max_position_embeddings=256)
    torch.manual_seed(0)
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**shape, intermediate_size=128))
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, intermediate_size=96, moe_intermediate_size=32, num_experts=6,
                                              num_experts_per_tok=2, mlp_only_layers=[1]))


@pytest.mark.slow
@pytest.mark.parametrize("kind,model_class", [("qwen3", "Qwen3ForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM")])
def test_a_hugging_face_checkpoint_is_its_own_teacher(kind, model_class, tmp_path):
    """--distill-from takes the Qwen3 (or Qwen3-MoE) checkpoint itself, run by transformers' own model: its
    loss on a converted Lite student equals, KL and hidden-state terms included, that of the teacher
    converted to vanilla fusedkv."""
    from fusedkv import FusedKVForCausalLM
    from fusedkv.convert import convert_qwen3
    from fusedkv.train.distill import Distiller

    _hf_teacher(kind, 101).save_pretrained(tmp_path / kind)
    convert_qwen3(tmp_path / kind, tmp_path / "vanilla", kv_sharing="vanilla")
    convert_qwen3(tmp_path / kind, tmp_path / "lite", kv_sharing="fusedkv-lite")
    student = FusedKVForCausalLM.from_pretrained(tmp_path / "lite")
    x, y = torch.randint(0, 101, (2, 12)), torch.randint(0, 101, (2, 12))
    losses, teachers = {}, {}
    for name in (kind, "vanilla"):
        d = Distiller(str(tmp_path / name), student.config, "cpu", alpha=0.4, temperature=2.0, hidden_weight=0.5)
        losses[name], teachers[name] = (float(d(student, x, y).detach()), d.last_parts), type(d.teacher).__name__
    assert teachers == {kind: model_class, "vanilla": "FusedKVForCausalLM"}
    (a, pa), (b, pb) = losses[kind], losses["vanilla"]
    assert a == pytest.approx(b, rel=1e-5) and pa["kl"] > 1e-4 and pa["hidden"] > 0
    assert pa == pytest.approx(pb, rel=1e-4)


@pytest.mark.slow
def test_uptraining_a_converted_qwen3_from_the_qwen3_checkpoint_through_the_cli(tmp_path, nano_data):
    """`fusedkv convert QWEN3 --kv-sharing fusedkv-lite`, then `fusedkv train --init-from CONVERTED
    --distill-from QWEN3`."""
    _hf_teacher("qwen3", 512).save_pretrained(tmp_path / "qwen3")  # nano_data's vocabulary: the student trains on it
    _cli("convert", tmp_path / "qwen3", tmp_path / "lite", "--kv-sharing", "fusedkv-lite")
    out = _cli("train", "--init-from", tmp_path / "lite", "--distill-from", tmp_path / "qwen3", "--out",
               tmp_path / "student", "--max-steps", 2, "--preset", "nano", "--set", f"data={nano_data}",
               "--set", "threads=1", "--set", "ckpt_every=0")
    assert f"distilling from {tmp_path / 'qwen3'}" in out.stdout
    summary = json.loads((tmp_path / "student" / "summary.json").read_text())
    assert summary["plan"] == "fusedkv-lite" and summary["steps"] == 2
