"""A lean generation loop (gpt-fast style) that also times itself.

`model.generate()` (transformers) works with every plan; this loop exists for speed and measurement:
a preallocated `StaticKVCache` for the storage layers, prefill that asks only for the last position
(so reconstruction layers skip the rest of the prompt), and one forward per new token with nothing
else in the way. It records time-to-first-token and every decode step, which `fusedkv bench` reports.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .cache import StaticKVCache, kv_cache_nbytes
from .model.packing import LAYOUTS, set_decode_layout

WEIGHT_LAYOUTS = ("keep", "auto", *LAYOUTS)


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # [B, prompt + new]
    ttft_s: float
    step_s: list[float] = field(default_factory=list)
    cache_bytes: int = 0

    @property
    def tpot_s(self) -> float:
        """Median time per output token after the first (robust to a noisy machine)."""
        steps = sorted(self.step_s)
        return steps[len(steps) // 2] if steps else float("nan")


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """[B, V] logits -> [B, 1] token ids; temperature 0 is greedy."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, attention_mask: torch.Tensor | None = None,
             temperature: float = 0.0, top_k: int | None = None, static_cache: bool = True,
             eos_token_id: int | None = None, generator: torch.Generator | None = None,
             weight_layout: str = "keep", cache_factory=None) -> GenerationResult:
    """Generate `max_new_tokens` tokens (fewer if every row hits `eos_token_id`).

    `weight_layout`: "keep" (default) runs the model as the caller laid it out. "auto" first puts the
    weights in the layout this batch decodes fastest with (`fusedkv.model.packing.set_decode_layout`:
    packed for one-GEMV steps at small batch, row-major above), and "packed" / "row-major" force one;
    these re-lay out the caller's model in place and leave it so (same values, names and outputs; a
    change of layout copies the weights once, before the clock starts).
    `cache_factory(config, batch, max_len, dtype, device)` builds another cache instead (e.g.
    `fusedkv.quant.kivi_cache_factory(4)` for the 4-bit KIVI cache)."""
    batch, prompt_len = input_ids.shape
    total = prompt_len + max_new_tokens
    if total > model.config.max_position_embeddings:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"max_position_embeddings={model.config.max_position_embeddings}; shorten one of them"
        )
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout={weight_layout!r}: choose one of {WEIGHT_LAYOUTS}")
    if weight_layout != "keep":
        set_decode_layout(model, batch if weight_layout == "auto" else weight_layout)
    device = input_ids.device
    dtype = next(model.parameters()).dtype
    if cache_factory is not None:
        cache = cache_factory(model.config, batch, total, dtype, device)
    else:
        cache = StaticKVCache(model.config, batch, total, dtype, device) if static_cache else None
    mask = attention_mask
    if mask is not None:  # grow the padding mask in place instead of concatenating every step
        mask = torch.ones(batch, total, dtype=mask.dtype, device=device)
        mask[:, :prompt_len] = attention_mask

    _sync(device)
    start = time.perf_counter()
    out = model(input_ids, attention_mask=None if mask is None else mask[:, :prompt_len], cache=cache,
                use_cache=True, logits_to_keep=1)
    cache = out.cache
    token = sample_next(out.logits[:, -1], temperature, top_k, generator)
    _sync(device)
    ttft = time.perf_counter() - start

    tokens = [token]
    steps: list[float] = []
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    for pos in range(prompt_len, total - 1):
        if eos_token_id is not None:
            done |= token[:, 0] == eos_token_id
            if bool(done.all()):
                break
        t0 = time.perf_counter()
        out = model(token, attention_mask=None if mask is None else mask[:, : pos + 1], cache=cache, use_cache=True)
        token = sample_next(out.logits[:, -1], temperature, top_k, generator)
        _sync(device)
        steps.append(time.perf_counter() - t0)
        tokens.append(token)
    return GenerationResult(torch.cat([input_ids, *tokens], dim=1), ttft, steps, kv_cache_nbytes(cache))
