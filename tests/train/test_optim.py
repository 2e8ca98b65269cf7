"""The paper's optimiser: warm-up + cosine to 0.1 x peak, and which parameters are weight-decayed."""

from __future__ import annotations

import math

import pytest
import torch

from fusedkv import FusedKVConfig, FusedKVForCausalLM
from fusedkv.train import TrainConfig
from fusedkv.train.optim import build_optimizer, build_scheduler, lr_at, param_groups


def test_schedule_paper_values():
    peak, warm, total = 3e-4, 2000, 50_000
    assert lr_at(0, peak, warm, total, 0.1) == pytest.approx(peak / warm)
    assert lr_at(999, peak, warm, total, 0.1) == pytest.approx(peak / 2)
    assert lr_at(1999, peak, warm, total, 0.1) == pytest.approx(peak)  # end of warm-up: the peak
    assert lr_at(2000, peak, warm, total, 0.1) == pytest.approx(peak)  # cosine starts at the peak
    mid = warm + (total - warm - 1) / 2
    assert lr_at(mid, peak, warm, total, 0.1) == pytest.approx((peak + 3e-5) / 2)
    assert lr_at(total - 1, peak, warm, total, 0.1) == pytest.approx(3e-5)  # last step: 0.1 x peak
    rates = [lr_at(s, peak, warm, total, 0.1) for s in range(0, total, 97)]
    assert all(a <= b for a, b in zip(rates[:20], rates[1:21]))  # rising during warm-up
    cos = [lr_at(s, peak, warm, total, 0.1) for s in range(warm, total, 97)]
    assert all(a >= b for a, b in zip(cos, cos[1:]))  # then monotone down
    assert min(cos) >= 3e-5 - 1e-12


def test_scheduler_follows_lr_at():
    cfg = TrainConfig(preset="nano", max_steps=10, warmup_steps=3, lr=1e-2)
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=cfg.lr)
    sched = build_scheduler(opt, cfg, 10)
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([lr_at(s, 1e-2, 3, 10, 0.1) for s in range(10)])
    assert seen[-1] == pytest.approx(1e-3)


def _model(plan="fusedkv"):
    torch.manual_seed(0)
    cfg = FusedKVConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        kv_sharing=plan,
    )
    return FusedKVForCausalLM(cfg)


def test_weight_decay_groups():
    model = _model()
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    d, n = set(decay["names"]), set(no_decay["names"])
    assert d.isdisjoint(n) and d | n == {name for name, _ in model.named_parameters()}
    # Decayed: every 2-D weight matrix, embeddings and the LM head included.
    assert {
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.3.mlp.down_proj.weight",
    } <= d
    # Not decayed: norms and the fusion weights (3-D, but per-channel gains).
    fusion = {name for name in n if ".fusion." in name}
    assert fusion == {f"model.layers.{i}.self_attn.fusion.{kv}_weight" for i in (2, 3) for kv in "kv"}
    assert all(model.get_parameter(name).dim() == 3 for name in fusion)
    assert {
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.2.self_attn.q_norm.weight",
        "model.layers.0.self_attn.k_norm.weight",
    } <= n
    assert all("norm" in name or ".fusion." in name for name in n)
    assert all(model.get_parameter(name).dim() == 2 for name in d)


def test_decay_never_touches_fusion_or_norm_weights():
    """One AdamW step with zero gradients: only decoupled weight decay acts. Matrices shrink by
    (1 - lr * wd); fusion and norm weights must stay exactly as they are."""
    model = _model()
    cfg = TrainConfig(preset="nano", lr=0.5, weight_decay=0.1)
    opt = build_optimizer(model, cfg)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for name, p in model.named_parameters():
        if ".fusion." in name or "norm" in name:
            assert torch.equal(p, before[name]), name
        else:
            torch.testing.assert_close(p, before[name] * (1 - 0.5 * 0.1))
    assert not math.isclose(
        model.get_parameter("lm_head.weight").abs().sum().item(), before["lm_head.weight"].abs().sum().item()
    )
