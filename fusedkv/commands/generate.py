"""`fusedkv generate`: sample text from a checkpoint with the compact KV cache (static, 16-bit or KIVI),
reduced-precision weights and the package's own generation loop (`fusedkv.generation`). `--chat MESSAGE`
answers one chat turn instead: the checkpoint's chat template, its end-of-turn stops and sampling settings
(`fusedkv.chat`; `fusedkv chat` for a conversation)."""

from __future__ import annotations

import sys

import torch
from transformers import AutoTokenizer

from .. import argtypes
from ..cache import StaticKVCache
from ..chat import check_chat_template, sampling_settings, stop_ids
from ..engine.precision import apply_precision
from ..errors import UsageError
from ..flags import DTYPES, add_device_flag, add_dtype_flag, add_kivi_flags, add_seed_flag, kv_group
from ..generation import generate
from ..model import FusedKVForCausalLM
from ..quant import check_kivi_settings, kivi_cache_factory


def register(sub) -> None:
    p = sub.add_parser("generate", help="sample text from a checkpoint",
                       description="Generate text with the compact KV cache from a checkpoint directory "
                       "(e.g. runs/tiny-fusedkv/final).")
    p.add_argument("checkpoint", type=argtypes.non_empty,
                   help="checkpoint directory holding config.json, weights and tokenizer")
    p.add_argument("--prompt", default=None, help="prompt text, continued as it is (default 'ROMEO:')")
    p.add_argument("--chat", default=None, metavar="MESSAGE",
                   help="answer this user message instead: the checkpoint's chat template is applied and the answer "
                   "stops at its end of turn; sampling as the checkpoint's generation_config.json says unless "
                   "flags say otherwise (fusedkv chat for a conversation)")
    p.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system prompt")
    add_sampling_flags(p, "default 0.8; with --chat: the checkpoint's generation_config.json, else 0.7",
                       "default 50", "default 1; with --chat: generation_config.json, else 0.9",
                       "default: 100, with --chat 512 or generation_config.json's, or what the context leaves "
                       "after the prompt if that is less")
    p.add_argument("--num-samples", type=argtypes.int_range(1, 4096), default=1, help="samples (default 1)")
    add_seed_flag(p, 0, help="sampling seed")
    add_device_flag(p, "cpu")
    precisions = [*DTYPES, "half"]
    add_dtype_flag(p, "float32", tuple(precisions),
                   help="weights and KV cache; half = bfloat16 where the processor has bf16 arithmetic, else "
                   "float16. On CPU activations stay float32 (fusedkv.engine.precision)")
    p.add_argument("--weights", default=None, choices=[*precisions, "int8", "int4"],
                   help="weight storage instead of --dtype's (CPU, weight-only): int8 = one scale per output channel, "
                   "int4 = one f16 scale per 32 weights (Q4_0's format, least-squares scales) with the LM head at "
                   "int8, as llama.cpp's Q4 files keep theirs at 6 bits (--head-weights int4: every product at 4 bits)")
    p.add_argument("--head-weights", default=None, choices=[*precisions, "int8", "int4"],
                   help="the LM head's weight storage (CPU); default: int8 under --weights int4, else as the other "
                   "weights. Its error reaches the logits directly: on a trained model int4 with an int4 head changed "
                   "the top token at 4.6%% of positions, with an int8 head at 0.9%% (docs/cpu-decode.md)")
    p.add_argument("--kv-dtype", default=None, choices=precisions, help="KV cache dtype instead of --dtype's")
    add_kivi_flags(p, "KIVI 2/4-bit KV cache (fusedkv.quant): keys per channel, values per token, recent ones exact")
    p.set_defaults(func=run)


def add_sampling_flags(p, temperature: str, top_k: str, top_p: str, max_new_tokens: str) -> None:
    """The sampling flags `generate` and `chat` share (None when not given: each command has its defaults)."""
    p.add_argument("--max-new-tokens", type=argtypes.positive_int, default=None,
                   help=f"tokens to generate; prompt + these must fit the model context ({max_new_tokens})")
    p.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    p.add_argument("--temperature", type=argtypes.float_range(0.0), default=None,
                   help=f"sampling temperature, 0 is greedy ({temperature})")
    p.add_argument("--top-k", type=argtypes.non_negative_int, default=None,
                   help=f"sample from the k likeliest tokens, 0 for all ({top_k})")
    p.add_argument("--top-p", type=argtypes.float_range(0.0, 1.0, lo_open=True), default=None,
                   help=f"nucleus sampling: the smallest set of tokens reaching this probability ({top_p})")
    p.add_argument("--repetition-penalty", type=argtypes.float_range(0.0, lo_open=True), default=None,
                   help="divide the logits of tokens already in the text by this (transformers' repetition_penalty; "
                   "default 1 = off, with --chat / in chat: generation_config.json's)")


def load_checkpoint(checkpoint: str, device: str):
    """The model (eval mode, on `device`) and its tokenizer, checked to match."""
    model = FusedKVForCausalLM.from_pretrained(checkpoint).to(device).eval()
    try:
        tok = AutoTokenizer.from_pretrained(checkpoint)
    except Exception as e:  # noqa: BLE001 - any tokenizer failure means the same thing to the user
        raise ValueError(f"{checkpoint} has no usable tokenizer ({e}); train or copy one into it") from e
    if len(tok) > model.config.vocab_size:
        raise ValueError(f"the tokenizer in {checkpoint} has {len(tok)} tokens but the model's vocab_size="
                         f"{model.config.vocab_size}; use the tokenizer the model was trained with")
    return model, tok


def run(args) -> None:
    if args.chat is not None and args.prompt is not None:
        raise UsageError("give --prompt (text to continue) or --chat (a message to answer), not both")
    if args.system is not None and args.chat is None:
        raise UsageError("--system goes with --chat (a system prompt for the chat template)")
    model, tok = load_checkpoint(args.checkpoint, args.device)
    if args.chat is not None:  # the chat template's ids, the end-of-turn stops, the checkpoint's sampling
        check_chat_template(tok, args.checkpoint)
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.chat}]
        row = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]
        ids = torch.tensor([row] * args.num_samples, device=args.device)
        sampling, _ = sampling_settings(args.checkpoint, args.temperature, args.top_k, args.top_p,
                                        args.repetition_penalty, args.max_new_tokens, args.greedy)
        eos = stop_ids(model, tok, args.checkpoint)
    else:
        prompt = "ROMEO:" if args.prompt is None else args.prompt
        ids = tok([prompt] * args.num_samples, return_tensors="pt").input_ids.to(args.device)
        eos = model.config.eos_token_id if model.config.eos_token_id is not None else tok.eos_token_id
        sampling = None
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty after tokenisation; give some text with --prompt")
    room = model.config.max_position_embeddings - ids.shape[1]
    if room < 1:
        raise ValueError(f"the prompt is {ids.shape[1]} tokens but the model's context is "
                         f"{model.config.max_position_embeddings}; shorten --prompt")
    if args.max_new_tokens is None:  # the default fits the context; an explicit value is checked
        args.max_new_tokens = min(100 if sampling is None else sampling.max_new_tokens, room)
    elif args.max_new_tokens > room:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} does not fit: the prompt is {ids.shape[1]} tokens "
                         f"and the model's context is {model.config.max_position_embeddings}; use at most {room}")
    if sampling is None:  # a raw prompt: the defaults in --help
        greedy = args.greedy or args.temperature == 0
        temperature = 0.0 if greedy else 0.8 if args.temperature is None else args.temperature
        top_k = None if greedy else 50 if args.top_k is None else args.top_k
        top_p = 1.0 if greedy or args.top_p is None else args.top_p
        penalty = 1.0 if args.repetition_penalty is None else args.repetition_penalty
    else:
        temperature, top_k, top_p, penalty = (sampling.temperature, sampling.top_k, sampling.top_p,
                                              sampling.repetition_penalty)
    # reduced weights (the LM head's own format), KV width
    kv_dtype = apply_precision(model, args.dtype, args.weights, args.kv_dtype, args.head_weights)

    def cache(config, batch, max_len, dtype, device):
        return StaticKVCache(config, batch, max_len, kv_dtype, device)

    if args.kv_bits:  # the quantised cache instead (its residual window keeps the activations' dtype)
        group = kv_group(args, model.config.head_dim)
        check_kivi_settings(args.kv_bits, group, args.kv_residual, model.config.head_dim)
        cache = kivi_cache_factory(args.kv_bits, group, args.kv_residual)

    # The package's own loop: the compact static cache, prefill skipping, and the weight layout the
    # batch decodes fastest with (fusedkv.engine.packing).
    result = generate(model, ids, args.max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                      repetition_penalty=penalty, eos_token_id=eos,
                      generator=torch.Generator(args.device).manual_seed(args.seed), weight_layout="auto",
                      cache_factory=cache)
    stops = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    for row in result.tokens.tolist():
        new = row[ids.shape[1]:]
        cut = next((k + 1 for k, t in enumerate(new) if t in stops), len(new))  # up to its first EOS
        shown = new[:cut] if args.chat is not None else row[:ids.shape[1]] + new[:cut]  # a chat shows the answer
        print(tok.decode(shown, skip_special_tokens=True))
        print("-" * 40)
    new = result.tokens.shape[1] - ids.shape[1]
    elapsed = result.ttft_s + sum(result.step_s)
    print(f"plan {model.config.kv_sharing}: {new} new tokens x {ids.shape[0]} in {elapsed:.2f}s "
          f"({new * ids.shape[0] / elapsed:.1f} tok/s, first token after {result.ttft_s * 1e3:.0f} ms"
          f"{', native decode step' if result.native_step else ''}); KV cache held {result.cache_bytes:,} bytes",
          file=sys.stderr)
