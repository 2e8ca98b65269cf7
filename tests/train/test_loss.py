"""The one LM loss (fusedkv/model/loss.py): against a float64 reference, the same number through every
user (model forward with transformers labels, trainer, validation loss), and the gradient analysis on
the training recipe."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import torch

from fusedkv import FusedKVConfig, FusedKVForCausalLM
from fusedkv.analysis.gradients import record_gradient_norms
from fusedkv.eval.perplexity import validation_loss
from fusedkv.model.loss import IGNORE_INDEX, causal_lm_loss, lm_loss, shift_labels
from fusedkv.train import compute_loss
from fusedkv.train.optim import build_optimizer

PACKAGE = Path(__file__).resolve().parents[2] / "fusedkv"


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = FusedKVConfig(vocab_size=53, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                        num_attention_heads=2, max_position_embeddings=32, kv_sharing="fusedkv")
    return FusedKVForCausalLM(cfg)


def test_lm_loss_matches_a_float64_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=g)
    targets = torch.randint(0, 11, (3, 7), generator=g)
    targets[0, 2] = targets[2, 6] = IGNORE_INDEX
    logp = torch.log_softmax(logits.double(), -1)
    keep = targets != IGNORE_INDEX
    ref = -logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0][keep]
    assert torch.allclose(lm_loss(logits, targets).double(), ref.mean(), atol=1e-6)
    assert torch.allclose(lm_loss(logits, targets, "sum").double(), ref.sum(), atol=1e-5)
    per = lm_loss(logits, targets, "none")
    assert per.shape == targets.shape and per[0, 2] == 0 and torch.allclose(per[keep].double(), ref, atol=1e-6)
    assert shift_labels(torch.tensor([[5, 6, 7]])).tolist() == [[6, 7, IGNORE_INDEX]]
    # A window with no target at all (context only under a loss mask) contributes 0, not NaN, and its
    # gradient is zero rather than a poisoned step.
    logits.requires_grad_(True)
    none = lm_loss(logits, torch.full_like(targets, IGNORE_INDEX))
    none.backward()
    assert none.item() == 0.0 and torch.count_nonzero(logits.grad) == 0


def test_every_user_computes_the_same_loss():
    model = _model().eval()
    ids = torch.randint(0, 53, (2, 17), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1], ids[:, 1:]  # the data loader's convention
    with torch.no_grad():
        loader_style = float(compute_loss(model, x, y))
        hf_style = float(model(input_ids=x, labels=x).loss)  # transformers' labels: the model shifts
        hf_ref = float(lm_loss(model(input_ids=x).logits[:, :-1], x[:, 1:]))
        assert abs(hf_style - hf_ref) < 1e-6
        assert abs(validation_loss(model, [(x, y)], shifted=True) - loader_style) < 1e-6
        assert abs(validation_loss(model, [(x, x)]) - hf_style) < 1e-6
    # Nothing else in the package computes a cross-entropy of its own.
    others = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
              if re.search(r"\bcross_entropy\(", p.read_text()) and p.name != "loss.py"]
    assert others in ([], ["train/distill.py"]), others  # distillation mixes in a KL term (another owner)


def test_gradient_analysis_uses_the_training_recipe():
    """record_gradient_norms steps exactly like the trainer: its loss, its AdamW groups (no decay on
    norms and fusion weights), clipping at 1.0."""
    a, b = _model(seed=3).train(), _model(seed=3).train()
    gen = torch.Generator().manual_seed(4)
    batches = [tuple(torch.randint(0, 53, (2, 2, 16), generator=gen).unbind(0)) for _ in range(3)]
    record_gradient_norms(a, iter(batches), steps=3, lr=1e-2)
    recipe = SimpleNamespace(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    opt = build_optimizer(b, recipe)
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        causal_lm_loss(b, x, y).backward()
        torch.nn.utils.clip_grad_norm_(b.parameters(), 1.0)
        opt.step()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
