"""`fusedkv convert`: import a Hugging Face checkpoint (or a GGUF file) of any family `fusedkv.convert` knows,
or re-plan a vanilla fusedkv one."""

from __future__ import annotations

from .. import argtypes
from ..convert import FAMILIES, convert_checkpoint
from ..flags import add_fusion_init_flags, add_plan_flag, calibration_settings
from ..plan import VANILLA


def register(sub) -> None:
    families = "; ".join(f"{f.name} ({', '.join(f.model_types)})" for f in FAMILIES)
    p = sub.add_parser("convert", help="import a Hugging Face checkpoint (Qwen3, Llama, Mistral, Qwen2, Gemma, "
                       "DeepSeek)",
                       description=f"Convert a Hugging Face checkpoint directory (config.json + safetensors, sharded "
                       f"or not) or a GGUF file to FusedKV. Families (model_type): {families}; or a vanilla "
                       "fusedkv model. A GGUF file is read by transformers' GGUF loader (the gguf extra: pip install "
                       "'fusedkv[gguf]'), dequantised to float32, with its tokenizer and chat template. "
                       "With --plan vanilla the result gives transformers' logits; other plans drop the upper "
                       "layers' K/V projections and start their fusion from --fusion-init, ready for training. "
                       "A config field fusedkv cannot reproduce exactly is refused, naming the field. "
                       "DST is written whole or not at all; a non-empty DST is replaced only with --overwrite.")
    p.add_argument("src", type=argtypes.non_empty, help="checkpoint directory (transformers' save_pretrained layout) "
                   "or a .gguf file")
    p.add_argument("dst", type=argtypes.output_dir, help="output directory (new or empty)")
    add_plan_flag(p, default=VANILLA, help="the plan of the converted model (default vanilla; +W / +WF for "
                  "models with sliding-window layers)")
    add_fusion_init_flags(p)
    p.add_argument("--overwrite", action="store_true", help="replace DST if it already holds files")
    p.set_defaults(func=run)


def run(args) -> None:
    calibration = calibration_settings(args)
    if calibration is not None:
        from ..calibrate import Calibration, convert_calibrated

        model, _ = convert_calibrated(args.src, args.dst, args.plan, Calibration(**calibration), args.overwrite)
    else:
        model = convert_checkpoint(args.src, args.dst, kv_sharing=args.plan, fusion_init=args.fusion_init,
                                   overwrite=args.overwrite)
    plan = model.plan
    print(f"wrote {args.dst}: plan {args.plan}, storage layers {[i + 1 for i in plan.storage_layers]}, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters")
