"""A lean generation loop (gpt-fast style) that also times itself.

`model.generate()` (transformers) works with every plan; this loop exists for speed and measurement:
a preallocated `StaticKVCache` for the storage layers, prefill that asks only for the last position
(so reconstruction layers skip the rest of the prompt), and one forward per new token with nothing
else in the way; on CPU, where it covers the model, that forward is one native call through every
layer (`fusedkv.engine.native_step`). How the model runs (the weight layout, the native step, each layer's
attention implementation, the product kernels) is decided once, before prefill, by
`fusedkv.engine.select_runtime`; this loop only applies the `Runtime` it returns, and gives it back after.
It records time-to-first-token and every decode step, which `fusedkv bench` reports, and it is the loop
`fusedkv generate` samples with and `fusedkv chat` streams from (`on_token`; a `cache` that already holds
the conversation so far, so a new turn prefills only its new tokens).

Padding: the model takes left-padded batches (positions count real tokens only). A right-padded batch
(what a tokenizer that pads on the right gives) is re-aligned to the left before prefill, so every
row continues from its own last real token; a mask with holes inside a row is refused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .cache import StaticKVCache, kv_cache_nbytes
from .engine.selection import WEIGHT_LAYOUTS, select_runtime
from .errors import RunError
from .model.attention import first_real_key


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # [B, prompt + new]: the caller's input_ids as given, then the new tokens
    ttft_s: float
    step_s: list[float] = field(default_factory=list)
    cache_bytes: int = 0
    native_step: bool = False  # decode steps ran as one native call (`fusedkv.engine.native_step`)

    @property
    def tpot_s(self) -> float:
        """Median time per output token after the first (robust to a noisy machine)."""
        steps = sorted(self.step_s)
        return steps[len(steps) // 2] if steps else float("nan")


def _check_finite(logits: torch.Tensor) -> None:
    """NaN or infinite logits (corrupt weights, an overflow) would still give tokens (greedy argmax picks
    one); refuse them instead of returning a confident-looking wrong result."""
    if not bool(torch.isfinite(logits).all()):
        raise RunError("the model's logits are not finite (NaN or inf): its weights are corrupt or overflow in "
                       "this dtype; check the checkpoint, or run in float32")


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                generator: torch.Generator | None = None, top_p: float = 1.0) -> torch.Tensor:
    """[B, V] logits -> [B, 1] token ids; temperature 0 is greedy. `top_k` keeps the k likeliest tokens,
    `top_p` < 1 the smallest set whose probability reaches top_p (nucleus sampling; always >= 1 token)."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        drop = probs.cumsum(-1) - probs >= top_p  # mass before this token already reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)


def penalize_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' repetition penalty (CTRL, Keskar et al. 2019): the logit of every token already in the
    row (`seen`: [B, V] bool) is divided by `penalty` where positive, multiplied by it where negative."""
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def left_align(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move each row's real tokens to the right end (left padding), whatever side the padding was on.
    Rows must hold one contiguous run of real tokens; a row with holes, or with none, is refused."""
    valid = attention_mask.bool()
    batch, width = valid.shape
    lengths = valid.sum(-1)
    if bool((lengths == 0).any()):
        raise ValueError(f"attention_mask rows {(lengths == 0).nonzero().flatten().tolist()} have no real token; "
                         "drop empty prompts from the batch")
    first = valid.long().argmax(-1)
    last = width - 1 - valid.flip(-1).long().argmax(-1)
    holes = (last - first + 1) != lengths
    if bool(holes.any()):
        raise ValueError(f"attention_mask rows {holes.nonzero().flatten().tolist()} have padding between real "
                         "tokens; pad each prompt on one side only (left or right)")
    if bool((last == width - 1).all()):
        return input_ids, attention_mask  # already left-padded: nothing to move
    pos = torch.arange(width, device=input_ids.device)
    start = width - lengths  # where each row's real tokens begin once left-aligned
    real = pos[None, :] >= start[:, None]
    src = (first[:, None] + pos[None, :] - start[:, None]).clamp(0, width - 1)
    ids = torch.where(real, input_ids.gather(1, src), torch.zeros_like(input_ids))
    return ids, real.to(attention_mask.dtype)


@torch.inference_mode()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, attention_mask: torch.Tensor | None = None,
             temperature: float = 0.0, top_k: int | None = None, static_cache: bool = True,
             eos_token_id: int | None = None, generator: torch.Generator | None = None,
             weight_layout: str = "keep", cache_factory=None, top_p: float = 1.0,
             native_step: bool = True, cache=None, on_token=None,
             repetition_penalty: float = 1.0) -> GenerationResult:
    """Generate `max_new_tokens` tokens (fewer if every row hits `eos_token_id`, an id or a list of ids;
    rows that finish earlier keep sampling, cut them at their first EOS).

    `attention_mask` marks real tokens (1) and padding (0), on either side of each row (see the module
    docstring); the result keeps `input_ids` as given and appends the new tokens after them.

    `weight_layout`: "keep" (default) runs the model as the caller laid it out. "auto" first puts the
    weights in the layout this batch decodes fastest with (`fusedkv.engine.select_runtime` decides:
    packed for one-GEMV steps at small batch, row-major above; packed up to the native step's 16 rows where
    that step runs), and "packed" / "row-major" force one;
    these re-lay out the caller's model in place and leave it so (same values, names and outputs; a
    change of layout copies the weights once, before the clock starts).
    `cache_factory(config, batch, max_len, dtype, device)` builds another cache instead (e.g.
    `fusedkv.quant.kivi_cache_factory(4)` for the 4-bit KIVI cache).
    `native_step`: on CPU, run each decode step's layers as one native call where it covers the model and
    the cache (`fusedkv.engine.native_step.unsupported`: f32 weights in the packed layout, bf16 / int8
    blocks or int4 blocks, a static or KIVI cache, batch <= 16); False runs the model's modules every step.
    `cache`: a `StaticKVCache` that already holds the K/V of the first `cache.get_seq_length()` tokens of
    `input_ids` (and room for the rest and the new tokens); only the others are prefilled, and the cache is
    left holding every token but the last one sampled (no padding mask with it).
    `on_token(token)` is called with each new [B, 1] token as soon as it is sampled (streaming).
    `repetition_penalty` > 1 lowers the logits of tokens already in the row (`penalize_repeats`).
    Everything else (each attention layer's implementation, the product kernels) is what
    `fusedkv.engine.select_runtime` picks for this model, cache and batch, for this call only."""
    batch, prompt_len = input_ids.shape
    device = input_ids.device
    total = prompt_len + max_new_tokens
    if total > model.config.max_position_embeddings:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"max_position_embeddings={model.config.max_position_embeddings}; shorten one of them"
        )
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout={weight_layout!r}: choose one of {WEIGHT_LAYOUTS}")
    dtype = next(model.parameters()).dtype
    past = 0
    if cache is not None:  # a conversation's cache: its tokens are the prompt's first `past`
        past = cache.get_seq_length()
        if attention_mask is not None or cache_factory is not None:
            raise ValueError("generate(cache=...) continues one unpadded prompt: no attention_mask or cache_factory")
        if not past < prompt_len or total > cache.max_len:
            raise ValueError(f"the cache holds {past} tokens and has room for {cache.max_len}; the prompt is "
                             f"{prompt_len} tokens (it must hold fewer) + {max_new_tokens} new")
    elif cache_factory is not None:
        cache = cache_factory(model.config, batch, total, dtype, device)
    else:
        cache = StaticKVCache(model.config, batch, total, dtype, device) if static_cache else None
    mask = attention_mask
    prompt_ids = input_ids
    if mask is not None:  # grow the padding mask in place instead of concatenating every step
        if mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask has shape {tuple(mask.shape)} but input_ids {tuple(input_ids.shape)}; "
                             "give one mask entry per token")
        prompt_ids, prompt_mask = left_align(input_ids, attention_mask)
        if callable(getattr(cache, "set_padding", None)):  # a cache that must not count padding (KIVI's groups)
            cache.set_padding(prompt_mask)
        mask = torch.ones(batch, total, dtype=mask.dtype, device=device)
        mask[:, :prompt_len] = prompt_mask
    eos = None if eos_token_id is None else torch.tensor(eos_token_id, device=device).reshape(-1)
    seen = None
    if repetition_penalty != 1.0:  # [B, V]: the tokens of each row so far (padding too, as transformers counts it)
        seen = torch.zeros(batch, model.config.vocab_size, dtype=torch.bool, device=device)
        seen.scatter_(1, input_ids, True)

    def pick(logits):
        if seen is not None:
            logits = penalize_repeats(logits, seen, repetition_penalty)
        token = sample_next(logits, temperature, top_k, generator, top_p)
        if seen is not None:
            seen.scatter_(1, token, True)
        if on_token is not None:
            on_token(token)
        return token

    with select_runtime(model, cache=cache, batch=batch, native_step=native_step,
                        weight_layout=weight_layout) as runtime:
        runtime.sync()
        start = time.perf_counter()
        out = model(prompt_ids[:, past:], attention_mask=None if mask is None else mask[:, :prompt_len], cache=cache,
                    use_cache=True, logits_to_keep=1)
        cache = out.cache
        _check_finite(out.logits)  # before sampling, which would fail on them without saying why
        token = pick(out.logits[:, -1])
        runtime.sync()
        ttft = time.perf_counter() - start

        step = runtime.native_step
        kv_start = None
        if step is not None and mask is not None:  # left-aligned: each row's first real key, fixed from now on
            kv_start = first_real_key(mask[:, :prompt_len]).contiguous()
        tokens = [token]
        steps: list[float] = []
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        for pos in range(prompt_len, total - 1):
            if eos is not None:
                done |= torch.isin(token[:, 0], eos)
                if bool(done.all()):
                    break
            t0 = time.perf_counter()
            if step is not None:
                logits = step(token, kv_start, pos)
                cache.advance(1)
            else:
                logits = model(token, attention_mask=None if mask is None else mask[:, : pos + 1], cache=cache,
                               use_cache=True).logits
            token = pick(logits[:, -1])
            runtime.sync()
            steps.append(time.perf_counter() - t0)
            tokens.append(token)
        return GenerationResult(torch.cat([input_ids, *tokens], dim=1), ttft, steps, kv_cache_nbytes(cache),
                                step is not None)
