"""`fusedkv uptrain SRC OUT --plan P`: convert a pretrained full-cache model, distil it back from the original,
evaluate and report, in one resumable command (fusedkv.uptrain.pipeline).

Under torchrun: `torchrun --nproc_per_node=N -m fusedkv.cli uptrain SRC OUT --distributed fsdp ...`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from .. import argtypes
from ..flags import add_device_flag, add_fusion_init_flags, add_plan_flag, add_seed_flag, calibration_settings
from ..plan import DEFAULT_PLAN
from ..train.config import DISTRIBUTED_MODES, PRESET_NAMES, resolve_config

# The recipe under the preset's (lowest layer; --set and the flags win): a pretrained model needs a short
# warm-up and a learning rate below pre-training's; the trainer's checkpoints make a killed run resume.
DEFAULTS = {"max_steps": 300, "lr": 1e-3, "warmup_steps": 10, "eval_every": 50, "ckpt_every": 50,
            # measured together at 2.2x the plain run's tokens/s on SmolLM2-135M (docs/uptraining.md): the lower
            # half keeps its weights under every plan, and the teacher's top-64 are stored once per data
            "freeze_lower_layers": True, "teacher_topk": 64}

DESCRIPTION = """\
Uptrain a pretrained full-cache model to a half-size-cache plan, in one command:

  1. convert SRC (any family `fusedkv convert` imports, or a vanilla fusedkv model) to --plan: the upper
     layers' K/V projections are dropped, the fusion starts from --fusion-init          -> OUT/converted/
  2. evaluate SRC (run by transformers' own class) and the converted model on held-out text -> OUT/eval/
  3. train the converted model by distillation from SRC (loss = alpha T^2 KL + (1 - alpha) LM
     [+ hidden-state MSE]; fusedkv.train.distill), single process or torchrun DDP/FSDP2   -> OUT/train/
  4. evaluate the trained model on the same held-out windows
  5. report: loss, perplexity, the recovered share of the conversion gap, KV-cache bytes per token,
     curves                                                    -> OUT/report.md, report.json, curves.png

The data (--data, default the built-in corpus) is tokenised with SRC's tokenizer; its validation split is
the held-out text. Re-running the same command after a crash or Ctrl-C continues where it stopped (done
stages are skipped, training resumes from its last checkpoint). Settings come from the preset's recipe
(model dimensions come from SRC) with these defaults on top: """ + ", ".join(f"{k}={v}" for k, v in DEFAULTS.items())

EPILOG = """\
examples:
  fusedkv uptrain my-qwen3/ runs/qwen3-fusedkv --plan fusedkv
  fusedkv uptrain my-llama/ runs/llama-lite --plan fusedkv-lite --data corpus/ --set lr=3e-5 --max-steps 2000
  torchrun --nproc_per_node=8 -m fusedkv.cli uptrain my-llama/ runs/llama-fusedkv --plan fusedkv \\
      --distributed fsdp --set checkpoint_format=sharded
  fusedkv memory --uptrain my-llama/ --plan fusedkv --gpus 8     # memory and time first
"""


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("src", type=argtypes.non_empty, help="the pretrained model: a Hugging Face checkpoint directory "
                   "(config.json, safetensors, tokenizer), a vanilla fusedkv model, or a .gguf file (imported once "
                   "into OUT.source)")
    p.add_argument("out", type=argtypes.output_dir, help="output directory (new, or an uptraining run to continue)")
    add_plan_flag(p, default=DEFAULT_PLAN, help=f"the KV-sharing plan to convert to (default {DEFAULT_PLAN})")
    add_fusion_init_flags(p)
    p.add_argument("--data", metavar="SPEC",
                   help="training and held-out text, as `fusedkv train --data` (default builtin)")
    p.add_argument("--preset", choices=PRESET_NAMES,
                   help="the training recipe (batch, context, schedule; default tiny)")
    p.add_argument("--config", metavar="FILE.yaml", help="YAML file of TrainConfig fields")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="any TrainConfig field (repeatable), e.g. --set lr=3e-5 --set seq_len=2048")
    p.add_argument("--max-steps", type=argtypes.positive_int, metavar="N", help=f"training steps (default "
                   f"{DEFAULTS['max_steps']})")
    add_seed_flag(p, None, help="data order and initialisation seed")
    p.add_argument("--distill-alpha", type=argtypes.float_range(0.0, 1.0), metavar="A",
                   help="weight of the KL term (default 0.5; 1 = distillation only)")
    p.add_argument("--distill-temperature", type=argtypes.positive_float, metavar="T",
                   help="softmax temperature (default 1)")
    p.add_argument("--distill-hidden-weight", type=argtypes.float_range(0.0), metavar="W",
                   help="weight of the per-layer hidden-state MSE (default 0: off)")
    p.add_argument("--distributed", choices=DISTRIBUTED_MODES, help="under torchrun: ddp, or fsdp (FSDP2)")
    add_device_flag(p, None, indexed=False)
    p.add_argument("--grad-checkpointing", action="store_true", default=None, help="activation checkpointing")
    p.add_argument("--overwrite", action="store_true", help="start over: delete what OUT holds")
    p.add_argument("--quiet", action="store_true", help="no progress bars or stage lines")
    return p


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("uptrain", help="convert + distil + evaluate + report a pretrained model, resumable",
                              description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=handle, handler=handle)
    return p


def build(args: argparse.Namespace, command: str = ""):
    """The `Uptrain` the flags ask for (no file is read but the YAML config). Paths are made absolute, so the
    settings a re-run compares name files, not how they were typed."""
    from .pipeline import Uptrain

    src, out = Path(args.src).absolute(), Path(args.out).absolute()
    data = str(Path(args.data).absolute()) if args.data and Path(args.data).exists() else args.data
    defaults = dict(DEFAULTS)
    if args.distill_hidden_weight:  # hidden-state matching needs the live teacher: no stored top-K
        defaults["teacher_topk"] = 0
    cfg = resolve_config(
        args.config, [f"{k}={v}" for k, v in defaults.items()] + list(args.sets),
        preset=args.preset, data=data, max_steps=args.max_steps, seed=args.seed,
        init_from=str(out / "converted"), distill_from=str(src), tokenizer=str(src),
        distill_alpha=args.distill_alpha, distill_temperature=args.distill_temperature,
        distill_hidden_weight=args.distill_hidden_weight, out_dir=str(out / "train"),
        distributed=args.distributed, device=args.device, grad_checkpointing=args.grad_checkpointing,
        progress=False if args.quiet else None)
    return Uptrain(src=src, out=out, plan=args.plan, fusion_init=args.fusion_init, cfg=cfg, command=command,
                   calibration=calibration_settings(args))


def handle(args: argparse.Namespace) -> int:
    from ..convert.sources import source_directory
    from ..errors import check_device
    from .pipeline import run_uptrain

    check_device(args.device)
    command = "fusedkv " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    out = Path(args.out)  # a GGUF source: imported once beside OUT (OUT.source), the checkpoint every step reads
    args.src = str(source_directory(args.src, out.parent / f"{out.name}.source"))
    run_uptrain(build(args, command), overwrite=args.overwrite, progress=not args.quiet)
    return 0
