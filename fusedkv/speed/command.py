"""`fusedkv bench`: the inference benchmark from the command line (table, JSON, PNG)."""

from __future__ import annotations

from pathlib import Path

from .. import argtypes
from ..engine.precision import head_format, kv_dtype_for, weight_format
from ..errors import UsageError, writing
from ..flags import add_device_flag, add_dtype_flag, add_kivi_flags, add_plan_flag, kv_group
from ..kernels import native
from ..plan import COMPARED_PLANS, VANILLA
from ..quant import check_kivi_settings
from ..utils import write_json_atomic


def register(sub) -> None:
    p = sub.add_parser(
        "bench", help="inference speed and memory: TTFT, TPOT, cache bytes vs vanilla and transformers",
        description="Measure every plan interleaved in one process (medians over repeats): KV cache bytes, "
        "time to first token, time per output token and decode tokens/s, with ratios to vanilla and to "
        "transformers' Qwen3ForCausalLM.generate on the same vanilla weights.")
    add_plan_flag(p, default=list(COMPARED_PLANS), many=True,
                  help=f"the plans to time, comma-separated (default {','.join(COMPARED_PLANS)})")
    p.add_argument("--prompt-lens", type=argtypes.int_list(1, 1 << 20), default=[256, 1024, 2048],
                   help="comma-separated prompt lengths (default 256,1024,2048)")
    p.add_argument("--batch-sizes", type=argtypes.int_list(1, 4096), default=[1, 4],
                   help="comma-separated batch sizes (default 1,4)")
    p.add_argument("--new-tokens", type=argtypes.int_range(1, 1 << 20), default=16,
                   help="decode steps per measurement (default 16)")
    p.add_argument("--repeats", type=argtypes.int_range(1, 1000), default=3, help="interleaved repeats (default 3)")
    p.add_argument("--layers", type=argtypes.int_range(2, 1024), default=8, help="decoder layers (default 8)")
    p.add_argument("--hidden", type=argtypes.int_range(2, 1 << 16), default=512, help="hidden size (default 512)")
    p.add_argument("--heads", type=argtypes.int_range(1, 1024), default=8, help="attention heads (default 8)")
    p.add_argument("--head-dim", type=argtypes.int_range(2, 1024), default=64, help="head dim, even (default 64)")
    p.add_argument("--vocab", type=argtypes.int_range(2, 1 << 20), default=8192, help="vocabulary (default 8192)")
    p.add_argument("--sliding-window", type=argtypes.int_range(1, 1 << 20), default=None,
                   help="benchmark a sliding-window hybrid with this window (paper App. A.6; plans PLAN+W / PLAN+WF "
                   "choose which layer types are shared)")
    p.add_argument("--window-group", type=argtypes.int_range(2, 1024), default=4,
                   help="with --sliding-window: each group of this many layers is all window layers but the last "
                   "(default 4: three window + one full, as in the paper)")
    p.add_argument("--experts", type=argtypes.int_range(2, 1024), default=None,
                   help="benchmark a mixture-of-experts model (Qwen3-MoE MLP in every layer) with this many "
                   "experts; each expert is the dense MLP's width over --experts-per-tok (a token's active MLP is "
                   "dense-sized)")
    p.add_argument("--experts-per-tok", type=argtypes.int_range(1, 1024), default=2,
                   help="with --experts: experts per token (default 2)")
    p.add_argument("--mla-rank", type=argtypes.int_range(1, 1 << 16), default=None,
                   help="benchmark multi-head latent attention (DeepSeek-V3) with this kv_lora_rank; the decoupled "
                   "RoPE key is a quarter of --head-dim (paper App. A.6.1)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers Qwen3 baseline")
    add_kivi_flags(p, "also time each plan decoding through a KIVI cache of these bit widths, e.g. 4 or 2,4",
                   many_bits=True)
    p.add_argument("--precisions", default="",
                   help="extra rows per plan with reduced-precision weights and KV cache on CPU, comma-separated "
                   "WEIGHTS/KV (weights float32, bfloat16, float16, half, int8, int4; KV float32, bfloat16, float16, "
                   "half), e.g. float32/half,half/half,int8/half,int4/half (int4: LM head at int8; int4@int4/half: "
                   "at int4 too); benchmarks/cpu_decode.py adds llama.cpp next to them")
    add_device_flag(p, "cpu")
    add_dtype_flag(p, "float32", help="weights, activations and KV cache")
    p.add_argument("--threads", type=argtypes.int_range(1, 1024), default=None,
                   help="torch CPU threads (default: torch's choice; 1 avoids OpenMP stalls on a loaded machine)")
    p.add_argument("--json", dest="json_path", type=argtypes.output_file("bench.json"),
                   help="also write the rows as JSON here")
    p.add_argument("--plot", default=None, type=argtypes.output_file("bench.png"),
                   help="PNG of TTFT/TPOT ratios against prompt length")
    p.add_argument("--gpu-suite", action="store_true",
                   help="run the GPU suite instead (kernels vs SDPA, TTFT/TPOT at 8k-128k in bf16); needs CUDA")
    p.set_defaults(func=run)


def run(args) -> None:
    import torch

    # The benchmarks are imported when the command runs, not when the CLI starts (every command pays that).
    if args.gpu_suite:
        from .gpu_suite import main as gpu_main

        if not torch.cuda.is_available():  # bench has no --dry-run: name the suite's own entry point, which has
            raise UsageError("--gpu-suite needs CUDA, and no CUDA GPU is visible; to run its code paths at tiny "
                             "sizes on CPU: python -m fusedkv.speed.gpu_suite --dry-run")

        return gpu_main([])
    from .inference import BenchShape, format_table, plot, run_inference_bench, shape_config

    _check_outputs(args.json_path, args.plot)

    if args.threads:
        torch.set_num_threads(args.threads)

    plans = args.plan  # checked while parsing (fusedkv.flags)
    shape = BenchShape(num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                       num_attention_heads=args.heads, head_dim=args.head_dim, vocab_size=args.vocab,
                       sliding_window=args.sliding_window, window_group=args.window_group,
                       architecture=_architecture(args))
    shape_config(shape, plans)  # a bad combination (e.g. MLA with a window, Lite on MLA) fails before any work
    from tqdm import tqdm

    lens, batches = args.prompt_lens, args.batch_sizes
    if args.kv_bits:
        for bits in args.kv_bits:
            check_kivi_settings(bits, kv_group(args, args.head_dim), args.kv_residual, args.head_dim)
    precisions = tuple(x.strip() for x in args.precisions.split(",") if x.strip())
    if precisions:
        if args.device != "cpu":
            raise ValueError("--precisions: reduced-precision weights are a CPU decode path; use --dtype on a GPU")
        for spec in precisions:
            weights, _, kv = spec.partition("/")
            weights, _, head = weights.partition("@")
            weight_format(weights), kv_dtype_for(kv or weights), head_format(weights, head or None)  # refused early
    per_plan = 1 + len(args.kv_bits) + len(precisions)
    runs_per_shape = per_plan * len(set(plans) | {VANILLA}) + (0 if args.no_hf else 1)
    total = args.repeats * len(lens) * len(batches) * runs_per_shape
    bar = tqdm(total=total, desc="bench", unit="run")

    def progress(msg):
        bar.set_postfix_str(msg, refresh=False)
        bar.update()

    try:  # close the bar on an error too, so the error line starts a line of its own
        rows = run_inference_bench(shape, plans, lens, batches, args.new_tokens, args.repeats, not args.no_hf,
                                   args.device, getattr(torch, args.dtype), progress, tuple(args.kv_bits),
                                   kv_group(args, args.head_dim), args.kv_residual, precisions)
    finally:
        bar.close()
    kernels = ("; native CPU decode kernels " + ("on" if native.available() else "off (FUSEDKV_NATIVE_KERNELS=0 "
               "or no C compiler)")) if args.device == "cpu" else ""
    print(f"\nmodel: {vars(shape)}, {args.dtype} on {args.device} ({torch.get_num_threads()} threads), "
          f"{args.new_tokens} decode steps, "
          f"median of {args.repeats} interleaved repeats{kernels}\n")
    print(format_table(rows))
    if args.json_path:
        with writing(args.json_path):
            write_json_atomic(args.json_path, rows)
    if args.plot:
        plot(rows, args.plot)
        print(f"\nplot: {args.plot}")


def _architecture(args) -> dict:
    """The MoE / MLA fields of the benchmarked model (Qwen3-MoE and DeepSeek-V3 names)."""
    arch = {}
    if args.experts:
        if args.experts_per_tok > args.experts:
            raise UsageError(f"--experts-per-tok {args.experts_per_tok} is more than --experts {args.experts}")
        arch.update(num_experts=args.experts, num_experts_per_tok=args.experts_per_tok,
                    moe_intermediate_size=max(1, 3 * args.hidden // args.experts_per_tok))
    if args.mla_rank:
        rope = max(2, args.head_dim // 4)
        # head_dim is the RoPE width under MLA (DeepSeek-V3's convention); keys are nope + rope = --head-dim wide
        arch.update(kv_lora_rank=args.mla_rank, q_lora_rank=None, qk_rope_head_dim=rope, head_dim=rope,
                    qk_nope_head_dim=args.head_dim - rope, v_head_dim=args.head_dim)
    return arch


def _check_outputs(*paths: str | None) -> None:
    """Output files are checked before minutes of measuring, not when the results are written."""
    for path in paths:
        if path is None:
            continue
        out = Path(path)
        if out.is_dir():
            raise UsageError(f"{out} is a directory; give a file name")
        if not out.parent.is_dir():
            raise UsageError(f"{out}: directory {out.parent} does not exist")
