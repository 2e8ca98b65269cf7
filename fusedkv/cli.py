"""The `fusedkv` command line: one subcommand per job, each a thin layer over the library.

    fusedkv plans      the KV-sharing plans with their cache capacity and I/O for a model shape
    fusedkv train      train a model (default: a tiny FusedKV model on the built-in corpus)
    fusedkv generate   sample text from a checkpoint
    fusedkv chat       chat with an instruct checkpoint (its chat template, streamed answers)
    fusedkv convert    import a Hugging Face checkpoint (Qwen3, Llama, Mistral, Qwen2, Gemma, DeepSeek)
    fusedkv uptrain    convert + distil + evaluate a pretrained model, resumable (fusedkv.uptrain)
    fusedkv eval       validation loss, perplexity, lm-eval tasks, RULER-style long-context tasks
    fusedkv compare    train and evaluate several plans under one budget (the paper's tables)
    fusedkv bench      inference speed and memory: TTFT, TPOT, cache bytes
    fusedkv analyze    the paper's analyses as pictures (dense-fusion heat maps, gradient norms)

Every subcommand is a module with a `register(subparsers)` function (`COMMANDS` lists them) that sets
`func` (its handler) and checks its flags while parsing (`fusedkv.argtypes`; the flags several commands
share are defined once, in `fusedkv.flags`); `main` runs the handler under the one error
policy of `fusedkv.errors`: exit 0 done, 2 bad input, 1 failure while running, 130 interrupted, each
with one line on stderr (`--debug` or FUSEDKV_DEBUG=1 shows the traceback instead).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__
from .argtypes import Parser, add_debug_flag
from .errors import debug_enabled, run_command

EPILOG = """\
exit status: 0 done, 2 bad input (a flag, a path, a config), 1 failure while running,
130 interrupted (training saves a checkpoint first; continue with --resume).
--debug (or FUSEDKV_DEBUG=1) shows the full traceback of an error.

start with `fusedkv train` (a tiny model on the built-in corpus), then
`fusedkv generate runs/tiny-fusedkv/final`; `fusedkv COMMAND --help` for each command."""


def _from_module(module: str):
    """The `register` of a subcommand's module, or None if that subpackage is not part of this build."""
    try:
        return importlib.import_module(module).register
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            return None
        raise


# Every subcommand, in the order `fusedkv --help` lists them: the module whose register(subparsers) adds it.
COMMANDS = (
    "fusedkv.commands.plans",
    "fusedkv.train.command",
    "fusedkv.train.memory_command",
    "fusedkv.commands.generate",
    "fusedkv.commands.chat",
    "fusedkv.commands.convert",
    "fusedkv.uptrain.command",
    "fusedkv.eval.command",
    "fusedkv.prune.command",
    "fusedkv.experiments.command",
    "fusedkv.speed.command",
    "fusedkv.analysis.command",
    "fusedkv.serving.command",
)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fusedkv", description="Train, evaluate and serve decoder LMs with half-size KV caches "
                    "(FusedKV, arXiv:2512.03870).", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"fusedkv {__version__}")
    add_debug_flag(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for module in COMMANDS:
        register = _from_module(module)
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
