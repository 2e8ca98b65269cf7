"""The `fusedkv` command line: one subcommand per job, each a thin layer over the library.

    fusedkv plans      the KV-sharing plans with their cache capacity and I/O for a model shape
    fusedkv train      train a model (default: a tiny FusedKV model on the built-in corpus)
    fusedkv generate   sample text from a checkpoint
    fusedkv convert    import a Hugging Face checkpoint (Qwen3, Llama, Mistral, Qwen2, Gemma, DeepSeek)
    fusedkv uptrain    convert + distil + evaluate a pretrained model, resumable (fusedkv.uptrain)
    fusedkv eval       validation loss, perplexity, lm-eval tasks, RULER-style long-context tasks
    fusedkv compare    train and evaluate several plans under one budget (the paper's tables)
    fusedkv bench      inference speed and memory: TTFT, TPOT, cache bytes
    fusedkv analyze    the paper's analyses as pictures (dense-fusion heat maps, gradient norms)

Every subcommand is added by a `register(subparsers)` function that sets `func` (its handler) and
checks its flags while parsing (`fusedkv.argtypes`); `main` runs the handler under the one error
policy of `fusedkv.errors`: exit 0 done, 2 bad input, 1 failure while running, 130 interrupted, each
with one line on stderr (`--debug` or FUSEDKV_DEBUG=1 shows the traceback instead).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from . import argtypes
from .argtypes import Parser, add_debug_flag
from .errors import debug_enabled, run_command
from .plan import VANILLA

EPILOG = """\
exit status: 0 done, 2 bad input (a flag, a path, a config), 1 failure while running,
130 interrupted (training saves a checkpoint first; continue with --resume).
--debug (or FUSEDKV_DEBUG=1) shows the full traceback of an error.

start with `fusedkv train` (a tiny model on the built-in corpus), then
`fusedkv generate runs/tiny-fusedkv/final`; `fusedkv COMMAND --help` for each command."""


def _from_module(module: str):
    """The `register` of a subcommand implemented in a subpackage, or None if that subpackage is not
    part of this build."""
    try:
        return importlib.import_module(module).register
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            return None
        raise


def register_plans(sub):
    p = sub.add_parser("plans", help="print the KV-sharing plans with cache capacity and I/O",
                       description="Cache capacity and per-step cache I/O of every plan, relative to vanilla "
                       "multi-head attention with the same number of query heads (paper Table 1).")
    p.add_argument("--layers", type=argtypes.int_range(2, 4096), default=16,
                   help="num_hidden_layers (default 16)")
    p.add_argument("--heads", type=argtypes.int_range(1, 4096), default=16, help="num_attention_heads (default 16)")
    p.add_argument("--kv-heads", type=argtypes.int_range(1, 4096), default=None,
                   help="KV heads for non-GQA plans, dividing --heads (default: --heads)")
    p.add_argument("--head-dim", type=argtypes.int_range(2, 4096), default=128,
                   help="head_dim, even for RoPE (default 128)")
    p.add_argument("--seq-len", type=argtypes.positive_int, default=8192,
                   help="context length for the bytes column (default 8192)")
    p.add_argument("--bytes", type=argtypes.int_range(1, 8), default=2,
                   help="bytes per element (2 for bf16/fp16, 4 for fp32)")
    p.add_argument("--layout", action="store_true", help="also print each plan's per-layer source map")
    p.set_defaults(func=_run_plans)


def plans_table(layers: int, heads: int, kv_heads: int | None, head_dim: int, seq_len: int, nbytes: int) -> str:
    from .config import FusedKVConfig
    from .plan import CHOICE_DESCRIPTIONS, PLAN_CHOICES, resolve_plan_choice
    from .utils import human_bytes

    rows = ["| plan | storage layers | KV heads | cache vs MHA | cache I/O vs MHA | bytes/token | "
            f"cache at {seq_len} tokens | what it does |", "|---|---|---|---|---|---|---|---|"]
    for name in PLAN_CHOICES:
        choice = resolve_plan_choice(name)
        c = FusedKVConfig(num_hidden_layers=layers, num_attention_heads=heads, head_dim=head_dim,
                          hidden_size=heads * head_dim, kv_sharing=choice.sharing,
                          num_key_value_heads=choice.num_key_value_heads(heads, kv_heads))
        plan = c.plan
        per_token = c.kv_cache_bytes_per_token(nbytes)
        io = plan.elements_read_per_token() * c.num_key_value_heads / (2 * layers * heads)
        rows.append(
            f"| {name} | {len(plan.storage_layers)}/{layers} | {c.num_key_value_heads} | "
            f"{c.kv_cache_fraction():.3g} | {io:.3g} | {per_token:,} | {human_bytes(per_token * seq_len)} | "
            f"{CHOICE_DESCRIPTIONS[name]} |"
        )
    return "\n".join(rows)


def _run_plans(args) -> None:
    from .plan import PLAN_NAMES, build_plan

    print(plans_table(args.layers, args.heads, args.kv_heads, args.head_dim, args.seq_len, args.bytes))
    if args.layout:  # KV-head counts do not change the layout: the sharing plans alone
        for name in PLAN_NAMES:
            print(f"\n{name}:")
            for line in build_plan(name, args.layers).describe():
                print("  " + line)


def _add_generate(sub):
    p = sub.add_parser("generate", help="sample text from a checkpoint",
                       description="Generate text with the compact KV cache from a checkpoint directory "
                       "(e.g. runs/tiny-fusedkv/final).")
    p.add_argument("checkpoint", type=argtypes.non_empty,
                   help="checkpoint directory holding config.json, weights and tokenizer")
    p.add_argument("--prompt", default="ROMEO:", help="prompt text (default 'ROMEO:')")
    p.add_argument("--max-new-tokens", type=argtypes.positive_int, default=None,
                   help="tokens to generate; prompt + these must fit the model context (default: 100, or "
                   "what the context leaves after the prompt if that is less)")
    p.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    p.add_argument("--temperature", type=argtypes.float_range(0.0), default=0.8,
                   help="sampling temperature, 0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=argtypes.non_negative_int, default=50,
                   help="sample from the k likeliest tokens, 0 for all (default 50)")
    p.add_argument("--top-p", type=argtypes.float_range(0.0, 1.0, lo_open=True), default=1.0,
                   help="nucleus sampling: the smallest set of tokens reaching this probability (default 1)")
    p.add_argument("--num-samples", type=argtypes.int_range(1, 4096), default=1, help="samples (default 1)")
    p.add_argument("--seed", type=argtypes.seed, default=0, help="sampling seed (default 0)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    precisions = ["float32", "bfloat16", "float16", "half"]
    p.add_argument("--dtype", default="float32", choices=precisions,
                   help="weights and KV cache (default float32); half = bfloat16 where the processor has bf16 "
                   "arithmetic, else float16. On CPU activations stay float32 (fusedkv.engine.precision)")
    p.add_argument("--weights", default=None, choices=[*precisions, "int8", "int4"],
                   help="weight storage instead of --dtype's (CPU, weight-only): int8 = one scale per output channel, "
                   "int4 = one f16 scale per 32 weights (llama.cpp's Q4_0 rule)")
    p.add_argument("--kv-dtype", default=None, choices=precisions, help="KV cache dtype instead of --dtype's")
    p.add_argument("--kv-bits", type=argtypes.positive_int, default=None,
                   help="KIVI 2/4-bit KV cache (fusedkv.quant): keys per channel, values per token, recent ones exact")
    p.add_argument("--kv-group", type=argtypes.positive_int, default=None,
                   help="KIVI group size G (default: 32, or the largest smaller size dividing the head "
                   "dimension and --kv-residual)")
    p.add_argument("--kv-residual", type=argtypes.positive_int, default=128,
                   help="KIVI full-precision residual length R, a multiple of G (default 128)")
    p.set_defaults(func=_run_generate)


def _run_generate(args) -> None:
    import torch
    from transformers import AutoTokenizer

    from .generation import generate
    from .model import FusedKVForCausalLM

    model = FusedKVForCausalLM.from_pretrained(args.checkpoint).to(args.device).eval()
    try:
        tok = AutoTokenizer.from_pretrained(args.checkpoint)
    except Exception as e:  # noqa: BLE001 - any tokenizer failure means the same thing to the user
        raise ValueError(f"{args.checkpoint} has no usable tokenizer ({e}); train or copy one into it") from e
    if len(tok) > model.config.vocab_size:
        raise ValueError(f"the tokenizer in {args.checkpoint} has {len(tok)} tokens but the model's vocab_size="
                         f"{model.config.vocab_size}; use the tokenizer the model was trained with")
    ids = tok([args.prompt] * args.num_samples, return_tensors="pt").input_ids.to(args.device)
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty after tokenisation; give some text with --prompt")
    room = model.config.max_position_embeddings - ids.shape[1]
    if room < 1:
        raise ValueError(f"the prompt is {ids.shape[1]} tokens but the model's context is "
                         f"{model.config.max_position_embeddings}; shorten --prompt")
    if args.max_new_tokens is None:
        args.max_new_tokens = min(100, room)  # the default fits the context; an explicit value is checked
    elif args.max_new_tokens > room:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} does not fit: the prompt is {ids.shape[1]} tokens "
                         f"and the model's context is {model.config.max_position_embeddings}; use at most {room}")
    eos = model.config.eos_token_id if model.config.eos_token_id is not None else tok.eos_token_id
    from .cache import StaticKVCache
    from .engine.precision import apply_precision

    kv_dtype = apply_precision(model, args.dtype, args.weights, args.kv_dtype)  # reduced weights, KV width

    def cache(config, batch, max_len, dtype, device):
        return StaticKVCache(config, batch, max_len, kv_dtype, device)

    if args.kv_bits:  # the quantised cache instead (its residual window keeps the activations' dtype)
        from .quant import check_kivi_settings, default_group_size, kivi_cache_factory

        group = default_group_size(model.config.head_dim, args.kv_residual) if args.kv_group is None else args.kv_group
        check_kivi_settings(args.kv_bits, group, args.kv_residual, model.config.head_dim)
        cache = kivi_cache_factory(args.kv_bits, group, args.kv_residual)

    # The package's own loop: the compact static cache, prefill skipping, and the weight layout the
    # batch decodes fastest with (fusedkv.engine.packing).
    result = generate(model, ids, args.max_new_tokens, temperature=0.0 if args.greedy else args.temperature,
                      top_k=None if args.greedy else args.top_k, top_p=1.0 if args.greedy else args.top_p,
                      eos_token_id=eos, generator=torch.Generator(args.device).manual_seed(args.seed),
                      weight_layout="auto", cache_factory=cache)
    stops = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    for row in result.tokens.tolist():
        new = row[ids.shape[1]:]
        cut = next((k + 1 for k, t in enumerate(new) if t in stops), len(new))  # up to its first EOS
        print(tok.decode(row[:ids.shape[1]] + new[:cut], skip_special_tokens=True))
        print("-" * 40)
    new = result.tokens.shape[1] - ids.shape[1]
    elapsed = result.ttft_s + sum(result.step_s)
    print(f"plan {model.config.kv_sharing}: {new} new tokens x {ids.shape[0]} in {elapsed:.2f}s "
          f"({new * ids.shape[0] / elapsed:.1f} tok/s, first token after {result.ttft_s * 1e3:.0f} ms"
          f"{', native decode step' if result.native_step else ''}); KV cache held {result.cache_bytes:,} bytes",
          file=sys.stderr)


def register_convert(sub):
    from .convert import FAMILIES

    families = "; ".join(f"{f.name} ({', '.join(f.model_types)})" for f in FAMILIES)
    p = sub.add_parser("convert", help="import a Hugging Face checkpoint (Qwen3, Llama, Mistral, Qwen2, Gemma, ...)",
                       description=f"Convert a Hugging Face checkpoint directory (config.json + safetensors, sharded "
                       f"or not) to FusedKV. Families (model_type): {families}; or a vanilla fusedkv model. "
                       "With --kv-sharing vanilla the result gives transformers' logits; other plans drop the upper "
                       "layers' K/V projections and start their fusion from --fusion-init, ready for training. "
                       "A config field fusedkv cannot reproduce exactly is refused, naming the field. "
                       "DST is written whole or not at all; a non-empty DST is replaced only with --overwrite.")
    p.add_argument("src", type=argtypes.non_empty, help="checkpoint directory (transformers' save_pretrained layout)")
    p.add_argument("dst", type=argtypes.non_empty, help="output directory (new or empty)")
    p.add_argument("--kv-sharing", default=VANILLA, help="plan (default vanilla; see `fusedkv plans`), e.g. fusedkv, "
                   "fusedkv+gqa, fusedkv+W / +WF for models with sliding-window layers")
    p.add_argument("--fusion-init", default="equivalent", choices=["equivalent", "normal", "iterative"])
    p.add_argument("--overwrite", action="store_true", help="replace DST if it already holds files")
    p.set_defaults(func=_run_convert)


def _run_convert(args) -> None:
    from .convert import convert_checkpoint

    model = convert_checkpoint(args.src, args.dst, kv_sharing=args.kv_sharing, fusion_init=args.fusion_init,
                               overwrite=args.overwrite)
    plan = model.plan
    print(f"wrote {args.dst}: plan {args.kv_sharing}, storage layers {[i + 1 for i in plan.storage_layers]}, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters")


# Every subcommand, in the order `fusedkv --help` lists them: a register(subparsers) function, or the
# module that exposes one.
_COMMANDS = (
    register_plans,
    "fusedkv.train.command",
    "fusedkv.train.plan_command",
    _add_generate,
    register_convert,
    "fusedkv.uptrain.command",
    "fusedkv.eval.command",
    "fusedkv.prune.command",
    "fusedkv.experiments.command",
    "fusedkv.bench.command",
    "fusedkv.analysis.command",
    "fusedkv.serving.command",
)

def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fusedkv", description="Train, evaluate and serve decoder LMs with half-size KV caches "
                    "(FusedKV, arXiv:2512.03870).", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version="fusedkv 0.1.0")
    add_debug_flag(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for entry in _COMMANDS:
        register = _from_module(entry) if isinstance(entry, str) else entry
        if register is not None:
            register(sub)
    for p in sub.choices.values():  # --debug after the command too; SUPPRESS keeps the global value
        add_debug_flag(p, default=argparse.SUPPRESS)
    parser.commands = sub.choices
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `fusedkv` command; returns the exit status (see `fusedkv.errors`)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = None
    if "--" in argv:  # a command that runs another program (serve) takes what follows `--` as its arguments
        cut = argv.index("--")
        head, _ = parser.parse_known_args(argv[:cut])
        if getattr(head, "pass_through", None):
            argv, rest = argv[:cut], argv[cut + 1:]
    args, unknown = parser.parse_known_args(argv)
    if rest is not None:
        setattr(args, args.pass_through, rest)
    elif getattr(args, "pass_through", None):
        setattr(args, args.pass_through, [])
    if unknown:  # reported by the subcommand's parser, so the message names the command
        parser.commands.get(args.command, parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return run_command(args.command, args.func, args, debug=debug_enabled(args.debug))


if __name__ == "__main__":
    sys.exit(main())
