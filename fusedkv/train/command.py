"""`fusedkv train`: the command line of the training subsystem.

`register(subparsers)` adds the `train` subcommand to the main `fusedkv` CLI; `python -m
fusedkv.train.command [flags]` runs the same command stand-alone (and is what `torchrun -m` launches
for DDP/FSDP). With no flags it trains the `tiny` FusedKV model on the built-in corpus (no downloads)
into `runs/tiny-fusedkv/`.

Exit status (fusedkv/errors.py): 0 done; 2 bad input, including an out_dir another run is using (one
line on stderr, nothing overwritten); 1 a failure while running (a diverged loss, a full disk: the
last good checkpoint is named); 130 / 143 stopped by SIGINT / SIGTERM after saving a checkpoint
(continue with `--resume`). FUSEDKV_DEBUG=1 shows the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import yaml

from ..argtypes import Parser, add_debug_flag, output_dir
from ..errors import EXIT_INTERRUPTED, EXIT_TERMINATED, UsageError, debug_enabled, report, run_command
from ..flags import add_device_flag, add_plan_flag, add_seed_flag
from . import full_checkpoint as ckpt_io
from .config import DISTRIBUTED_MODES, PRESET_NAMES, resolve_config
from .rundir import RunDirLock, find_resume_checkpoint

DESCRIPTION = """\
Pre-train a FusedKV decoder (or any KV-sharing plan) with the paper's recipe: AdamW (0.9, 0.95),
weight decay 0.1 on weight matrices, gradient clipping 1.0, linear warm-up then cosine decay to
0.1 x the peak learning rate.

With no arguments: the `tiny` FusedKV model (4 layers, hidden 192, context 256) on the built-in
Shakespeare + King James corpus (1.2M tokens, about 5 minutes on 2 CPU cores with data
preparation), written to runs/tiny-fusedkv/:
  final/               the model (save_pretrained, safetensors) and its tokenizer
  checkpoints/         training checkpoints (model, optimizer, scheduler, data position, RNG)
  metrics.csv, tb/     per-step loss, learning rate, throughput and validation loss (TensorBoard)
  learning_curves.png  train and validation loss against tokens
  summary.json         final validation loss/perplexity, tokens/s and KV-cache size
The tokenised corpus is cached in runs/data/ (or $FUSEDKV_DATA_DIR) and reused by later runs.

Settings come from the preset, then --config FILE.yaml, then --set KEY=VALUE, then the flags
below. Every TrainConfig field can be --set (e.g. lr=1e-3, seq_len=512, eval_every=50,
model.num_hidden_layers=6); see fusedkv/train/config.py or --print-config. On a CPU shared with
other jobs, --set threads=1 can be several times faster than one thread per core.
"""

EPILOG = """\
examples:
  fusedkv train                                     # tiny FusedKV on the built-in corpus
  fusedkv train --plan vanilla                      # -> runs/tiny-vanilla
  fusedkv train --preset nano --max-steps 20        # seconds; for smoke tests
  fusedkv train --data my_texts/ --set vocab_size=8192 --set max_tokens=20M
  fusedkv train --resume runs/tiny-fusedkv          # continue after Ctrl-C or a crash
  fusedkv train --init-from runs/tiny-fusedkv/final --rope-base 50000 --set seq_len=512 \\
                --out runs/tiny-fusedkv-512           # continued training at a longer context
  torchrun --nproc_per_node=2 -m fusedkv.train.command --distributed fsdp --preset nano
"""


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = p.add_argument_group("what to train")
    g.add_argument("--preset", choices=PRESET_NAMES, help="model size and recipe (default: tiny)")
    add_plan_flag(g, help="the KV-sharing plan (default: fusedkv)")
    g.add_argument("--config", metavar="FILE.yaml", help="YAML file of TrainConfig fields")
    g.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any TrainConfig field (repeatable), e.g. --set lr=1e-3 --set model.hidden_size=256",
    )
    g.add_argument(
        "--data",
        metavar="SPEC",
        help="builtin (default), a .txt file or directory, .jsonl, .parquet, hf:NAME[:CONFIG[:SPLIT]], "
        "or a directory made by prepare_dataset",
    )
    g.add_argument(
        "--max-steps", type=int, metavar="N", help="optimiser steps (overrides the preset's budget)"
    )
    add_seed_flag(g, None, help="seed for initialisation and data order")
    g.add_argument(
        "--init-from",
        metavar="MODEL_DIR",
        help="start from a saved model's weights (and tokenizer), e.g. runs/x/final",
    )
    g.add_argument(
        "--distill-from",
        metavar="MODEL_DIR",
        help="uptraining: distil from this full-cache model, a fusedkv or a Qwen3 / Qwen3-MoE checkpoint (loss = "
        "alpha KL + (1 - alpha) LM; fusedkv.train.distill)",
    )
    g.add_argument("--distill-alpha", type=float, metavar="A", help="weight of the KL term (default 0.5)")
    g.add_argument("--distill-temperature", type=float, metavar="T", help="softmax temperature (default 1.0)")
    g.add_argument(
        "--distill-hidden-weight", type=float, metavar="W", help="weight of the hidden-state MSE (default 0: off)"
    )
    g.add_argument(
        "--rope-theta",
        "--rope-base",
        dest="rope_theta",
        type=float,
        metavar="THETA",
        help="RoPE base (paper: 10000; 50000 / 500000 for continued long-context training)",
    )
    g = p.add_argument_group("where and how")
    g.add_argument("--out", metavar="DIR", type=output_dir, help="output directory (default: runs/<preset>-<plan>)")
    g.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        metavar="RUN_DIR",
        help="continue a run from its newest intact checkpoint: the run in --out, or RUN_DIR (a run "
        "directory, or one of its checkpoints/step-N); the saved settings are reused",
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        default=None,
        help="start afresh even if --out holds a run (deletes its checkpoints and final model)",
    )
    g.add_argument(
        "--distributed",
        choices=DISTRIBUTED_MODES,
        help="data parallelism under torchrun: ddp, or fsdp (FSDP2, sharded per decoder layer)",
    )
    g.add_argument("--compile", action="store_true", default=None, help="torch.compile each decoder layer")
    g.add_argument(
        "--grad-checkpointing",
        action="store_true",
        default=None,
        help="activation checkpointing: recompute decoder layers in backward to save memory",
    )
    add_device_flag(g, None, indexed=False)
    g.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    g.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    return p


def register(subparsers) -> argparse.ArgumentParser:
    """Add `train` to the `fusedkv` CLI; the handler is stored as `func` (and `handler`)."""
    p = subparsers.add_parser(
        "train",
        help="pre-train a FusedKV model (default: tiny model on the built-in corpus)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=handle, handler=handle)
    return p


def build_config(args: argparse.Namespace, hold: contextlib.ExitStack | None = None):
    """The TrainConfig the flags ask for; with --resume, the checkpoint's saved config underneath.

    With `hold`, the run directory to resume is locked (rundir.RunDirLock) before its checkpoint is
    read, so a run still writing there is reported as such instead of being read half-way."""
    flags = dict(
        preset=args.preset,
        plan=args.plan,
        data=args.data,
        max_steps=args.max_steps,
        seed=args.seed,
        init_from=args.init_from,
        distill_from=args.distill_from,
        distill_alpha=args.distill_alpha,
        distill_temperature=args.distill_temperature,
        distill_hidden_weight=args.distill_hidden_weight,
        rope_theta=args.rope_theta,
        out_dir=args.out,
        resume=args.resume,
        overwrite=args.overwrite,
        distributed=args.distributed,
        compile=args.compile,
        grad_checkpointing=args.grad_checkpointing,
        device=args.device,
        progress=False if args.quiet else None,
    )
    if not args.resume:
        return resolve_config(args.config, args.sets, **flags)
    # --resume alone continues --out (or the default run directory); --resume DIR names a run directory
    # or one checkpoint. rundir.find_resume_checkpoint decides (here and in train()).
    target = args.resume if isinstance(args.resume, str) else (
        args.out or resolve_config(args.config, args.sets, **{**flags, "resume": None}).out_dir
    )
    run_dir = args.out or _run_dir_of(target)
    if hold is not None and _is_rank0():
        hold.enter_context(RunDirLock(run_dir))
    point = find_resume_checkpoint(target)
    if _is_rank0():
        for w in point.warnings:
            print(f"fusedkv train: warning: {w}", file=sys.stderr)
    saved = ckpt_io.read_train_config(point.checkpoint)
    saved.update(resume=False, overwrite=False, progress=True)
    # The run continues where the checkpoint lies now (runs may be moved), not in the saved out_dir.
    return resolve_config(
        args.config, args.sets, base=saved, **{**flags, "resume": str(point.checkpoint), "out_dir": run_dir}
    )


def _run_dir_of(target: str) -> str:
    """The run directory of a --resume target: itself, or the run a checkpoint directory belongs to."""
    p = Path(target)
    if not ckpt_io.checkpoint_root(p).is_dir() and p.parent.name == "checkpoints":
        return str(p.parent.parent)
    return str(p)


def _check_init_from(cfg) -> None:
    """--init-from is a local model directory: a missing one is named here, instead of transformers
    taking the name for a Hugging Face hub id and failing on the network."""
    if cfg.init_from is None or cfg.resume:
        return
    p = Path(cfg.init_from)
    if not p.is_dir():
        what = "is a file" if p.exists() else "does not exist"
        raise UsageError(f"--init-from {cfg.init_from} {what}; give a saved model directory (config.json, weights, "
                         "tokenizer), e.g. runs/tiny-fusedkv/final")


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def handle(args: argparse.Namespace) -> int:
    from .trainer import train  # when the command runs, not when the CLI starts (every command pays that)

    try:
        with contextlib.ExitStack() as hold:
            cfg = build_config(args, hold)
            _check_init_from(cfg)
            if args.print_config:
                print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
                return 0
            result = train(cfg)
    except KeyboardInterrupt as e:
        # Before training started (data preparation, model building) or a second Ctrl-C while saving:
        # the last complete checkpoint, if any, is intact.
        print(
            f"fusedkv train: interrupted ({e or 'before training started'}); nothing more was saved",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    except Exception as e:
        if debug_enabled(getattr(args, "debug", False)):
            raise
        return report("train", e)
    if result.get("stopped"):
        return EXIT_TERMINATED if result["stopped"] == "SIGTERM" else EXIT_INTERRUPTED
    return 0


def main(argv=None) -> int:
    """`python -m fusedkv.train.command` (what torchrun launches): `fusedkv train`'s parser and error policy."""
    parser = Parser(
        prog="fusedkv train",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    return run_command("train", handle, args, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
