"""The flags several `fusedkv` commands share, each defined once.

* `--plan`: the one name of the KV-sharing plan on the command line, checked while parsing by the one parser
  of plan names (`fusedkv.plan.resolve_plan_choice`). `--kv-sharing`, its name in older scripts, is a hidden
  alias.
* `--kv-bits`, `--kv-group`, `--kv-residual`: the KIVI cache (`fusedkv.quant`), with the library's defaults
  (`kv_group` resolves a group left unset against the model's head dimension).
* `--device` (cpu, cuda, cuda:N or auto; whether it exists is `fusedkv.errors.check_device`'s, when the command
  runs), `--dtype` (`DTYPES`, a command narrowing or extending them), `--seed` (`argtypes.seed`) and
  `--fusion-init` (`fusedkv.config_fields.FUSION_INITS`): one definition each, the default and help per command.
* The calibration flags of a conversion (`--fusion-init calibrated`, `--calib-data`, `--calib-tokens`,
  `--sources`).
"""

from __future__ import annotations

import argparse

from . import argtypes
from .config_fields import FUSION_INITS
from .plan import CUSTOM, GQA, PLAN_CHOICES, resolve_plan_choice
from .quant import DEFAULT_GROUP_SIZE, DEFAULT_RESIDUAL_LENGTH, default_group_size

PLAN_HELP = (f"{', '.join(PLAN_CHOICES)} or {CUSTOM}, optionally +{GQA} (half the KV heads) and +W/+WF (which layer "
             "types a sliding-window hybrid shares), e.g. fusedkv+gqa; see `fusedkv plans`")


def plan_name(text: str) -> str:
    """argparse type: a plan as users type it (any name `resolve_plan_choice` accepts), kept as typed."""
    try:
        resolve_plan_choice(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def plan_names(text: str) -> list[str]:
    """argparse type: a comma-separated, non-empty list of plans, e.g. "vanilla,fusedkv+gqa"."""
    return [plan_name(name) for name in argtypes.name_list()(text)]


def add_plan_flag(parser, default: str | None = None, many: bool = False, help: str = "") -> None:
    """`--plan` (one plan, or with many=True a comma-separated list), and `--kv-sharing` as a hidden alias."""
    kind = plan_names if many else plan_name
    parser.add_argument("--plan", type=kind, default=default, metavar="PLAN[,PLAN...]" if many else "PLAN",
                        help=f"{help}{'; ' if help else ''}{PLAN_HELP}")
    hidden = ("--kv-sharing", "--plans") if many else ("--kv-sharing",)
    parser.add_argument(*hidden, dest="plan", type=kind, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def add_kivi_flags(parser, bits_help: str, many_bits: bool = False) -> None:
    """The KIVI cache: bit width(s), group size G and residual length R (`fusedkv.quant.kivi`)."""
    if many_bits:
        parser.add_argument("--kv-bits", type=argtypes.int_list(2, 4), default=[], help=bits_help)
    else:
        parser.add_argument("--kv-bits", type=argtypes.positive_int, default=None, help=bits_help)
    parser.add_argument("--kv-group", type=argtypes.positive_int, default=None,
                        help=f"KIVI group size G (default: {DEFAULT_GROUP_SIZE}, or the largest smaller size dividing "
                        "the head dimension and --kv-residual: `fusedkv.quant.default_group_size`)")
    parser.add_argument("--kv-residual", type=argtypes.positive_int, default=DEFAULT_RESIDUAL_LENGTH,
                        help=f"KIVI full-precision residual length R, a multiple of G "
                        f"(default {DEFAULT_RESIDUAL_LENGTH})")


def kv_group(args, head_dim: int) -> int:
    """The KIVI group size the flags ask for: --kv-group, or the default that fits `head_dim`."""
    return default_group_size(head_dim, args.kv_residual) if args.kv_group is None else args.kv_group


DTYPES = ("float32", "bfloat16", "float16")
DEVICE_WORDS = ("auto", "cpu", "cuda")


def device(text: str, indexed: bool = True) -> str:
    """argparse type: auto, cpu, cuda or (with `indexed`) cuda:N, as typed."""
    name, _, index = str(text).strip().partition(":")
    if name not in DEVICE_WORDS or (index and not (indexed and name == "cuda" and index.isdigit())):
        raise argparse.ArgumentTypeError(f"device {text!r}: use {', '.join(DEVICE_WORDS)}"
                                         f"{' or cuda:N' if indexed else ''}")
    return str(text).strip()


def add_device_flag(parser, default: str | None = "cpu", indexed: bool = True, help: str = "") -> None:
    """`--device`. `indexed=False` for commands that pick the GPU themselves (under torchrun, by local rank)."""
    kind = device if indexed else (lambda text: device(text, indexed=False))
    words = f"{', '.join(DEVICE_WORDS)}{' or cuda:N' if indexed else ''}; auto = cuda if one is visible"
    parser.add_argument("--device", type=kind, default=default, metavar="DEVICE",
                        help=f"{help}{'; ' if help else ''}{words} (default {default or 'auto'})")


def add_dtype_flag(parser, default: str, choices: tuple[str, ...] = DTYPES, help: str = "") -> None:
    """`--dtype`, one of `choices` (`DTYPES` unless a command narrows or extends them)."""
    parser.add_argument("--dtype", default=default, choices=choices, help=f"{help}{'; ' if help else ''}"
                        f"default {default}")


def add_seed_flag(parser, default: int | None = 0, help: str = "seed") -> None:
    """`--seed`, an integer in [0, 2**32)."""
    parser.add_argument("--seed", type=argtypes.seed, default=default,
                        help=f"{help} (default {0 if default is None else default})")


def add_fusion_init_flag(parser, default: str = "equivalent", help: str = "initial fusion weights",
                         choices: tuple[str, ...] = FUSION_INITS) -> None:
    """`--fusion-init`, one of the config's `FUSION_INITS` (a conversion adds `calibrated`)."""
    parser.add_argument("--fusion-init", default=default, choices=choices, help=f"{help} (default {default})")


# ---- the fusion initialisation of a conversion (`fusedkv convert`, `fusedkv uptrain`) ----------------------
CALIBRATED = "calibrated"  # fitted to the original model on calibration text (`fusedkv.calibrate`)
FUSION_INIT_CHOICES = (*FUSION_INITS, CALIBRATED)


def add_fusion_init_flags(parser) -> None:
    """`--fusion-init`, and the calibration flags that `--fusion-init calibrated` reads."""
    add_fusion_init_flag(parser, choices=FUSION_INIT_CHOICES,
                         help="initial fusion weights: equivalent (the unrolled iterative recurrence, paper App. A.3), "
                         "normal, iterative, or calibrated (fitted to the original model on --calib-data, with each "
                         "reconstruction layer's output and MLP projections refitted layer by layer)")
    parser.add_argument("--calib-data", default="builtin", metavar="SPEC",
                        help="calibration text for --fusion-init calibrated, as `fusedkv train --data` (default "
                        "builtin); keep it apart from the text you evaluate on")
    parser.add_argument("--calib-tokens", type=argtypes.int_range(2), default=8192, metavar="N",
                        help="calibration tokens (default 8192)")
    parser.add_argument("--sources", choices=("plan", "calibrated"), default="plan",
                        help="with --fusion-init calibrated: keep the plan's source layers (default) or choose each "
                        "reconstruction layer's own by least residual (written as a custom source map)")


def calibration_settings(args) -> dict | None:
    """The `fusedkv.calibrate.Calibration` fields the flags ask for; None unless --fusion-init calibrated."""
    if args.fusion_init != CALIBRATED:
        return None
    return dict(data=args.calib_data, tokens=args.calib_tokens, sources=args.sources)
