"""Scoring text the way decoding sees it: one token per forward through a (quantised) KV cache.

A KIVI cache changes nothing in a single full-sequence forward (a prefill attends over its own K/V in
full precision, KIVI Algorithm 1), so loss and perplexity under KV quantisation must be measured
token by token: the logits at position t come from a forward of token t alone, attending over the
cache as decoding would leave it after t tokens. `DecodeScorer` wraps a model so that the ordinary
evaluation code (`fusedkv.eval.perplexity.validation_loss`, sliding-window perplexity) scores it
this way with no change of its own.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


class DecodeScorer:
    """Callable like a causal LM (`scorer(input_ids, attention_mask=None).logits`, [B, T, V]), but every
    position is computed by a one-token decode step through a fresh cache from `make_cache(config)`."""

    def __init__(self, model, make_cache):
        self.model, self.make_cache = model, make_cache
        self.config = model.config

    def parameters(self):
        return self.model.parameters()

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("token-by-token scoring through a quantised cache takes unpadded batches only")
        cache = self.make_cache(self.model.config)
        logits = [self.model(input_ids[:, t:t + 1], cache=cache, use_cache=True).logits[:, -1]
                  for t in range(input_ids.shape[1])]
        return SimpleNamespace(logits=torch.stack(logits, 1), cache=cache)
