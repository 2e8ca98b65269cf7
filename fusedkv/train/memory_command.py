"""`fusedkv memory` (alias `plan-run`): memory per GPU and time of a training or uptraining run on a cluster,
before launching it.

    fusedkv memory --preset 4b --gpus 64 --gpu-memory 80GB --tokens-per-gpu-s 3000
    fusedkv memory --uptrain Llama-3.1-8B/ --plan fusedkv --gpus 8 --set seq_len=4096   # teacher counted too

The counting rules and their references are in `fusedkv.train.memory_estimate`.
"""

from __future__ import annotations

import argparse

from .. import argtypes
from ..errors import UsageError
from ..flags import add_dtype_flag, add_plan_flag
from .config import PRESET_NAMES, resolve_config
from .memory_estimate import estimate_run, format_estimate, parse_bytes

EPILOG = """\
examples:
  fusedkv memory --preset 4b --gpus 64 --gpu-memory 80GB
  fusedkv memory --preset 1.5b --gpus 8 --gpu-memory 141GB --micro-batch 2 --tokens-per-gpu-s 9000
  fusedkv memory --preset 332m --gpus 8 --peak-tflops 989 --mfu 0.4   # time from an assumed MFU
  fusedkv memory --preset tiny --gpus 1 --gpu-memory 24GB --dtype float32
  fusedkv memory --uptrain my-llama/ --plan fusedkv --gpus 8 --set seq_len=4096 --set global_batch_tokens=1Mi \\
      --set max_tokens=2B --peak-tflops 989      # `fusedkv uptrain`: the student and its teacher
Token counts take K, M, B (10^3, 10^6, 10^9) and Ki, Mi, Gi (2^10, 2^20, 2^30): a global batch is whole
sequences, so 1Mi (1,048,576 = 256 x 4096) where 1M (1,000,000) is not a multiple of seq_len.
(`plan-run` is the command's former name, still accepted.)
"""


def register(subparsers) -> argparse.ArgumentParser:
    """Add `memory`, and its former name `plan-run` (same flags, not listed in `fusedkv --help`)."""
    for name in ("memory", "plan-run"):
        listed = {"help": HELP} if name == "memory" else {}
        p = subparsers.add_parser(name, description=DESCRIPTION, epilog=EPILOG,
                                  formatter_class=argparse.RawDescriptionHelpFormatter, **listed)
        add_arguments(p)
        p.set_defaults(func=handle, handler=handle)
    return p


HELP = "memory per GPU (DDP / FSDP, activation checkpointing, an uptraining teacher) and training time"
DESCRIPTION = (
    "Parameters, gradients, AdamW state, activations at the preset's sequence length and the inference KV cache, "
    "per GPU under DDP and FSDP (full shard), with a verdict on whether it fits; and the time the preset's token "
    "budget takes at a given per-GPU throughput. With --uptrain SRC: the model is SRC converted to --plan and the "
    "distillation teacher (SRC, run by transformers) is counted too. (`plan-run` is this command's former name.)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=PRESET_NAMES, default="tiny",
                   help="model size and recipe (default: tiny); with --uptrain the recipe only")
    p.add_argument("--uptrain", metavar="SRC", type=argtypes.non_empty,
                   help="plan `fusedkv uptrain SRC`: SRC's config.json (a checkpoint directory: only config.json is "
                   "read) converted to --plan, and SRC as the teacher")
    p.add_argument("--teacher-dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                   help="the teacher's weights (default auto: the checkpoint's dtype; fusedkv loads it so on GPU)")
    p.add_argument("--distill-hidden", action="store_true",
                   help="hidden-state distillation (--distill-hidden-weight > 0): the teacher's hidden states are kept")
    add_plan_flag(p, help="KV-sharing plan (default: fusedkv)")
    p.add_argument("--gpus", type=argtypes.int_range(1, 1_000_000), default=1,
                   help="GPUs in the data-parallel group (default 1)")
    p.add_argument("--gpu-memory", default="80GB", help="memory of one GPU, e.g. 80GB or 141GiB (default 80GB)")
    p.add_argument("--seq-len", type=argtypes.int_range(2), help="training sequence length (default: the preset's)")
    p.add_argument("--micro-batch", type=argtypes.int_range(1, 1_000_000),
                   help="sequences per forward per GPU (default: the preset's)")
    add_dtype_flag(p, "bfloat16", ("bfloat16", "float32"),
                   help="bfloat16 autocast (GPU default) or float32 (CPU default)")
    p.add_argument("--activation-checkpointing", choices=("both", "on", "off"), default="both",
                   help="which columns to show (default both)")
    p.add_argument("--tokens-per-gpu-s", type=argtypes.positive_float, help="measured training throughput of one GPU")
    p.add_argument("--peak-tflops", type=argtypes.positive_float,
                   help="the GPU's peak dense bf16 TFLOP/s (time from an assumed MFU)")
    p.add_argument("--mfu", type=argtypes.float_range(0.0, 1.0, lo_open=True), default=0.4,
                   help="model FLOP utilisation with --peak-tflops (default 0.4)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="any TrainConfig field, e.g. --set global_batch_tokens=2Mi (binary: whole sequences)")


def handle(args) -> int:
    if args.gpus is not None and args.gpus < 1:
        raise ValueError(f"--gpus {args.gpus}: must be a positive number of GPUs")
    for flag, value in (("--seq-len", args.seq_len), ("--micro-batch", args.micro_batch)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: must be a positive integer")
    model = teacher = None
    if args.uptrain is not None:
        model, teacher = _uptrain_models(args)
    cfg = resolve_config(overrides=args.sets, preset=args.preset, plan=None if model else args.plan,
                         seq_len=args.seq_len, micro_batch_size=args.micro_batch,
                         init_from=args.uptrain, distill_from=args.uptrain)
    if model is not None and cfg.seq_len > model.max_position_embeddings:  # as `fusedkv uptrain` refuses it
        raise UsageError(f"seq_len={cfg.seq_len} is past the context of {args.uptrain} "
                         f"({model.max_position_embeddings} tokens, its max_position_embeddings): the source is the "
                         f"teacher of every window; use --set seq_len=N with N <= {model.max_position_embeddings}")
    plan = estimate_run(cfg, args.gpus, parse_bytes(args.gpu_memory), dtype=args.dtype,
                    tokens_per_gpu_s=args.tokens_per_gpu_s, peak_tflops=args.peak_tflops, mfu=args.mfu,
                    model=model, teacher=teacher)
    keep = {"both": (False, True), "on": (True,), "off": (False,)}[args.activation_checkpointing]
    plan.estimates = {k: v for k, v in plan.estimates.items() if k[1] in keep}
    print(format_estimate(plan))
    return 0


def _uptrain_models(args):
    """(the student's config, the teacher) of `fusedkv uptrain SRC --plan P`, from SRC's config.json."""
    import json
    from pathlib import Path

    from ..plan import DEFAULT_PLAN
    from .distill import teacher_student_configs
    from .memory_counts import count_teacher

    src = Path(args.uptrain)
    if src.is_file() and src.name == "config.json":
        src = src.parent
    if not (src / "config.json").is_file():
        raise ValueError(f"--uptrain {args.uptrain}: no config.json there; give the source checkpoint's directory")
    hf = json.loads((src / "config.json").read_text())
    teacher_cfg, student = teacher_student_configs(hf, args.plan or DEFAULT_PLAN, origin=str(src))
    dtype = "float32" if args.dtype == "float32" and args.teacher_dtype == "auto" else args.teacher_dtype
    return student, count_teacher(src, teacher_cfg, dtype, hidden=args.distill_hidden)
