"""Token-by-token scoring through a cache: equal to one full forward with a full-precision cache, and
with KIVI equal to scoring through the independent reference cache."""

import torch
from transformers import DynamicCache

from fusedkv.eval.perplexity import validation_loss
from fusedkv.quant import KIVICache
from fusedkv.quant.scoring import DecodeScorer
from tests.conftest import tiny_model
from tests.quant.test_kivi import ReferenceKIVICache


def test_decode_scoring_equals_the_full_forward_and_the_kivi_reference():
    model = tiny_model("fusedkv")
    ids = torch.randint(1, 97, (3, 41))
    batches = [(ids[:, :-1], ids[:, 1:])]
    full = validation_loss(model, batches, shifted=True)
    fp = validation_loss(DecodeScorer(model, lambda cfg: DynamicCache(config=cfg)), batches, shifted=True)
    assert abs(full - fp) < 1e-5
    kivi = validation_loss(DecodeScorer(model, lambda cfg: KIVICache(cfg, 2, 4, 8)), batches, shifted=True)
    ref = validation_loss(DecodeScorer(model, lambda cfg: ReferenceKIVICache(cfg, 2, 4, 8)), batches, shifted=True)
    assert abs(kivi - ref) < 1e-5 and abs(kivi - full) > 1e-4
