"""`fusedkv chat`: talk to an instruct checkpoint in the terminal (`fusedkv.chat.ChatSession`).

One line is one message; the answer streams as it is sampled. `/reset` clears the history, `/exit` or end of
input (Ctrl-D) ends with exit status 0, Ctrl-C during an answer stops that answer (it stays in the history as
far as it got). Input from a pipe works alike (no prompt is shown), so a conversation can be scripted.
What is not the answer (the settings, dropped history, statistics) goes to stderr.
"""

from __future__ import annotations

import sys

import torch

from .. import argtypes
from ..chat import ChatSession, check_chat_template, sampling_settings, stop_ids
from ..engine.precision import apply_precision
from ..flags import DTYPES, add_device_flag, add_dtype_flag, add_seed_flag
from .generate import add_sampling_flags, load_checkpoint

COMMANDS = "/reset clears the history, /exit or Ctrl-D ends, Ctrl-C stops an answer"


def register(sub) -> None:
    p = sub.add_parser("chat", help="chat with an instruct checkpoint", description="Chat with a checkpoint "
                       "through its chat template, answers streamed as they are sampled, the KV cache kept across "
                       f"turns. {COMMANDS}.")
    p.add_argument("checkpoint", type=argtypes.non_empty,
                   help="checkpoint directory holding config.json, weights and a tokenizer with a chat template")
    p.add_argument("--system", default=None, metavar="TEXT", help="system prompt (kept when old turns are dropped)")
    add_sampling_flags(p, "default: the checkpoint's generation_config.json, else 0.7", "default 50",
                       "default: generation_config.json's, else 0.9",
                       "per answer; default: generation_config.json's, else 512")
    add_seed_flag(p, 0, help="sampling seed")
    add_device_flag(p, "cpu")
    add_dtype_flag(p, "float32", (*DTYPES, "half"), help="weights and KV cache (as in fusedkv generate)")
    p.add_argument("--weights", default=None, choices=["float32", "bfloat16", "float16", "half", "int8", "int4"],
                   help="weight storage instead of --dtype's (CPU, weight-only; as in fusedkv generate)")
    p.add_argument("--stats", action="store_true",
                   help="after each answer, its tokens, speed and how much of the prompt came from the cache (stderr)")
    p.set_defaults(func=run)


def run(args) -> None:
    model, tok = load_checkpoint(args.checkpoint, args.device)
    check_chat_template(tok, args.checkpoint)
    sampling, source = sampling_settings(args.checkpoint, args.temperature, args.top_k, args.top_p,
                                         args.repetition_penalty, args.max_new_tokens, args.greedy)
    kv_dtype = apply_precision(model, args.dtype, args.weights)
    session = ChatSession(model, tok, sampling, stop_ids(model, tok, args.checkpoint), system=args.system,
                          kv_dtype=kv_dtype, generator=torch.Generator(args.device).manual_seed(args.seed))
    how = "greedy" if sampling.temperature == 0 else (f"temperature {sampling.temperature:g}, top-k "
                                                       f"{sampling.top_k or 'all'}, top-p {sampling.top_p:g}")
    if sampling.repetition_penalty != 1:
        how += f", repetition penalty {sampling.repetition_penalty:g}"
    note(f"fusedkv chat: plan {model.config.kv_sharing}, context {session.context} tokens, {how} ({source}). "
         f"{COMMANDS}.")
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input(">>> ") if interactive else sys.stdin.readline()
        except EOFError:
            line = ""
        except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
            print()
            note(f"({COMMANDS})")
            continue
        if not line:  # end of input
            if interactive:
                print()
            return
        text = line.strip()
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            session.reset()
            note("[history cleared]")
            continue
        if not text:
            continue
        try:
            turn = session.reply(text, write=lambda piece: print(piece, end="", flush=True), on_drop=lambda n: note(
                f"[dropped the oldest {n} exchange(s) to stay within the {session.context}-token context]"))
        except ValueError as e:  # a message too long for the context: say so and keep chatting
            note(f"error: {e}")
            continue
        print(flush=True)
        if turn.interrupted:
            note("[answer stopped]")
        elif args.stats:
            note(f"[{turn.new_tokens} tokens in {turn.seconds:.2f} s ({turn.new_tokens / turn.seconds:.1f} tok/s); "
                 f"prefilled {turn.prefilled} prompt tokens, {turn.reused} from the cache]")


def note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
