"""`fusedkv convert`: import a Hugging Face Qwen3 / Qwen3-MoE checkpoint, or re-plan a vanilla fusedkv one
(`fusedkv.convert`)."""

from __future__ import annotations

from .. import argtypes
from ..convert import convert_qwen3
from ..flags import add_plan_flag
from ..plan import VANILLA


def register(sub) -> None:
    p = sub.add_parser("convert", help="import a Hugging Face Qwen3 checkpoint",
                       description="Convert a Qwen3 checkpoint directory (model_type qwen3) to FusedKV. With "
                       "--plan vanilla the result gives transformers' logits; other plans drop the upper "
                       "layers' K/V projections and start their fusion from --fusion-init, ready for training. "
                       "DST is written whole or not at all; a non-empty DST is replaced only with --overwrite.")
    p.add_argument("src", type=argtypes.non_empty, help="Qwen3 checkpoint directory")
    p.add_argument("dst", type=argtypes.non_empty, help="output directory (new or empty)")
    add_plan_flag(p, default=VANILLA, help="the plan of the converted model (default vanilla)")
    p.add_argument("--fusion-init", default="equivalent", choices=["equivalent", "normal", "iterative"])
    p.add_argument("--overwrite", action="store_true", help="replace DST if it already holds files")
    p.set_defaults(func=run)


def run(args) -> None:
    model = convert_qwen3(args.src, args.dst, kv_sharing=args.plan, fusion_init=args.fusion_init,
                          overwrite=args.overwrite)
    plan = model.plan
    print(f"wrote {args.dst}: plan {args.plan}, storage layers {[i + 1 for i in plan.storage_layers]}, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters")
