"""Faster uptraining: the stored top-k teacher against the live teacher (within the truncation's bound), the
store's key, and frozen lower layers that stay bit-identical through training."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fusedkv import FusedKVConfig, FusedKVForCausalLM
from fusedkv.convert import from_qwen3_state, fusedkv_to_plan_config
from fusedkv.train.distill import Distiller, distillation_loss, topk_distillation_loss
from fusedkv.train.freeze import freeze_lower_layers, frozen_names
from fusedkv.train.teacher_cache import FP16_REL, TeacherTopK, WindowBatches

VOCAB = 96


def _models(tmp_path, vocab=VOCAB, tie=False):
    """A random vanilla teacher saved to tmp_path/teacher and its fusedkv conversion saved to tmp_path/student."""
    torch.manual_seed(0)
    cfg = FusedKVConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=4, max_position_embeddings=64, kv_sharing="vanilla",
                        tie_word_embeddings=tie)
    teacher = FusedKVForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper than a random init: a realistic share of the mass in the top few tokens
        teacher.lm_head.weight.mul_(40.0)
    teacher.save_pretrained(tmp_path / "teacher")
    student = from_qwen3_state(teacher.state_dict(), fusedkv_to_plan_config(cfg.to_dict(), "fusedkv"))
    student.save_pretrained(tmp_path / "student")
    return teacher, student


def _tokens(n=2000, vocab=VOCAB):
    return np.random.default_rng(0).integers(0, vocab, n).astype(np.uint16)


@pytest.mark.parametrize("k,T", [(8, 1.0), (24, 2.0)])
def test_stored_topk_loss_matches_the_live_teacher_within_the_stated_bound(tmp_path, k, T):
    """With the live teacher's logits t and the student's s, per position (module docstring of teacher_cache):
    KL_full - KL_bucket = p_tail * KL(p_tail || q_tail) >= 0 exactly, and the stored (float16) bucket KL is
    within sum_i p_i |log p_i| 2^-11 (1 + |log p_i - log q_i|) (+ the same for the tail) of the exact one."""
    teacher, student = _models(tmp_path)
    tokens = _tokens()
    store = TeacherTopK(tmp_path / "store", tmp_path / "teacher", tokens, 16, k, T, VOCAB)
    windows = np.array([3, 7, 7, 40])
    kd = Distiller(str(tmp_path / "teacher"), student.config, "cpu", alpha=1.0, temperature=T, store=store)
    x, y = store.window_inputs(windows)
    with torch.no_grad():
        stored = float(kd(student, x, y, windows=torch.from_numpy(windows)))
        live = float(distillation_loss(student(input_ids=x).logits, teacher(input_ids=x).logits, y, 1.0, T)[0])
        s = torch.log_softmax(student(input_ids=x).logits.double() / T, -1).flatten(0, 1)
        p_full = torch.log_softmax(teacher(input_ids=x).logits.double() / T, -1).flatten(0, 1)
    lp, ids = p_full.topk(k, -1)
    lq = s.gather(-1, ids)
    p, q = lp.exp(), lq.exp()
    p_tail, q_tail = 1 - p.sum(-1), 1 - q.sum(-1)
    bucket = (p * (lp - lq)).sum(-1) + p_tail * (p_tail.log() - q_tail.log())
    full = (p_full.exp() * (p_full - s)).sum(-1)
    in_tail = torch.ones_like(s, dtype=torch.bool).scatter(-1, ids, False)
    pt = torch.where(in_tail, p_full.exp(), 0) / p_tail[:, None]
    qt = torch.where(in_tail, s.exp(), 0) / q_tail[:, None]
    kl_tail = (pt * (pt.clamp(min=1e-300).log() - qt.clamp(min=1e-300).log())).sum(-1)
    T2 = T * T
    # The chain rule: the truncation loses exactly the tail's own KL, weighted by the teacher's tail mass.
    torch.testing.assert_close(full - bucket, p_tail * kl_tail, rtol=1e-6, atol=1e-9)
    assert float(full.mean()) * T2 == pytest.approx(live, rel=1e-4)
    assert float((p_tail * kl_tail).mean()) > 1e-4  # k < V: the bound is not trivially 0 here
    assert live - stored >= -1e-5
    rounding = p * lp.abs() * FP16_REL
    fp16_bound = (rounding * (1 + (lp - lq).abs())).sum(-1)  # the tail mass is stored in float32
    assert abs(stored - float(bucket.mean()) * T2) <= float(fp16_bound.mean()) * T2 + 1e-5
    assert abs(live - stored) <= float((p_tail * kl_tail + fp16_bound).mean()) * T2 + 1e-5
    # All of the vocabulary stored: nothing is truncated, the stored loss is the live one (to float16).
    whole = TeacherTopK(tmp_path / "store", tmp_path / "teacher", tokens, 16, VOCAB, T, VOCAB)
    loss, _ = topk_distillation_loss(student(input_ids=x).logits, *_filled(whole, teacher, windows), y, 1.0, T)
    assert float(loss.detach()) == pytest.approx(live, rel=2e-3)


def _filled(store, teacher, windows):
    store.fill(teacher, windows, "cpu")
    return store.lookup(windows, "cpu")


def test_the_store_is_keyed_by_teacher_data_and_settings(tmp_path):
    teacher, _ = _models(tmp_path)
    tokens = _tokens()
    a = TeacherTopK(tmp_path / "s", tmp_path / "teacher", tokens, 16, 8, 1.0, VOCAB)
    assert a.fill(teacher, np.array([1, 2, 2]), "cpu") == 2 and a.count_filled() == 2
    again = TeacherTopK(tmp_path / "s", tmp_path / "teacher", tokens, 16, 8, 1.0, VOCAB)
    assert again.dir == a.dir and again.count_filled() == 2  # another seed or plan: reused
    assert again.fill(teacher, np.array([1, 2]), "cpu") == 0
    logp, ids, tail = again.lookup(np.array([2]), "cpu")
    with torch.no_grad():
        want = F.log_softmax(teacher(input_ids=again.window_inputs(np.array([2]))[0]).logits, -1).topk(8, -1)
    torch.testing.assert_close(ids, want.indices)
    torch.testing.assert_close(logp, want.values, rtol=FP16_REL * 2, atol=1e-6)
    torch.testing.assert_close(tail, 1 - want.values.exp().sum(-1), rtol=1e-5, atol=1e-6)
    others = [TeacherTopK(tmp_path / "s", tmp_path / "teacher", tokens[:-100], 16, 8, 1.0, VOCAB),
              TeacherTopK(tmp_path / "s", tmp_path / "teacher", tokens, 32, 8, 1.0, VOCAB),
              TeacherTopK(tmp_path / "s", tmp_path / "teacher", tokens, 16, 4, 1.0, VOCAB),
              TeacherTopK(tmp_path / "s", tmp_path / "teacher", tokens, 16, 8, 2.0, VOCAB)]
    with torch.no_grad():
        teacher.model.layers[0].mlp.down_proj.weight[0, 0] += 1.0
    teacher.save_pretrained(tmp_path / "teacher")  # the teacher's weights changed: a new store
    others.append(TeacherTopK(tmp_path / "s", tmp_path / "teacher", tokens, 16, 8, 1.0, VOCAB))
    assert len({o.dir for o in others} | {a.dir}) == 6 and all(o.count_filled() == 0 for o in others)
    with pytest.raises(RuntimeError, match="not filled"):
        a.lookup(np.array([5]), "cpu")


def test_window_batches_are_a_pure_function_of_seed_and_step():
    tokens = _tokens(1000)
    b = WindowBatches(tokens, 16, 4, seed=3)
    first = [next(b) for _ in range(3)]
    x, y, w = first[2]
    assert torch.equal(x[0], torch.from_numpy(tokens[w[0] * 16:w[0] * 16 + 16].astype(np.int64)))
    assert torch.equal(y[0], torch.from_numpy(tokens[w[0] * 16 + 1:w[0] * 16 + 17].astype(np.int64)))
    resumed = WindowBatches(tokens, 16, 4, seed=3)
    resumed.load_state_dict({**b.state_dict(), "step": 2})
    assert torch.equal(next(resumed)[2], w)
    halves = [WindowBatches(tokens, 16, 2, seed=3, rank=r, world_size=2).batch_at(2)[2] for r in (0, 1)]
    assert torch.equal(torch.cat(halves), w)  # two ranks see the rows of one
    with pytest.raises(ValueError, match="grid"):
        resumed.load_state_dict({**b.state_dict(), "grid": False})


def test_freezing_a_tied_model_freezes_its_head_and_a_plan_where_every_layer_stores_keeps_only_the_embedding(
        tmp_path):
    _, student = _models(tmp_path, tie=True)
    assert freeze_lower_layers(student) == 2
    names = set(frozen_names(student))
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.1.self_attn.k_proj.weight"} <= names
    assert not any(n.startswith(("model.layers.2.", "model.layers.3.", "model.norm")) for n in names)
    vanilla = FusedKVForCausalLM(FusedKVConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                               num_attention_heads=2, kv_sharing="vanilla"))
    assert freeze_lower_layers(vanilla) == 0 and frozen_names(vanilla) == ["model.embed_tokens.weight"]


def test_freezing_keeps_the_lower_layers_bit_identical_after_training(tmp_path, nano_data):
    """Two steps of distillation from the stored teacher with the lower half frozen: the embedding and layers
    1-2 are bit for bit the converted model's, the upper layers moved; the store holds the windows trained on
    and a run of another seed reuses it."""
    from safetensors.torch import load_file

    from fusedkv.train import TrainConfig, train

    _models(tmp_path, vocab=512)
    common = dict(preset="nano", init_from=str(tmp_path / "student"), distill_from=str(tmp_path / "teacher"),
                  data=str(nano_data), max_steps=2, eval_every=0, final_eval_batches=1, ckpt_every=0,
                  progress=False, device="cpu", threads=1, freeze_lower_layers=True, teacher_topk=16, lr=1e-2)
    result = train(TrainConfig(**common, out_dir=str(tmp_path / "run")))
    before = load_file(tmp_path / "student" / "model.safetensors")
    after = load_file(tmp_path / "run" / "final" / "model.safetensors")
    lower = [n for n in before if n.startswith(("model.embed_tokens.", "model.layers.0.", "model.layers.1."))]
    upper = [n for n in before if n.startswith(("model.layers.2.", "model.layers.3."))]
    assert lower and upper and result["steps"] == 2
    assert all(torch.equal(before[n], after[n]) for n in lower)
    assert sum(not torch.equal(before[n], after[n]) for n in upper) == len(upper)
    store = next((nano_data / "teacher").iterdir())
    filled = np.fromfile(store / "filled.u8", dtype=np.uint8)
    assert 0 < filled.sum() <= 2 * 8  # the windows of two steps of nano's batch, each stored once
