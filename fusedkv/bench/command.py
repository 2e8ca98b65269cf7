"""`fusedkv bench`: the inference benchmark from the command line (table, JSON, PNG)."""

from __future__ import annotations

import json
from pathlib import Path

from ..plan import COMPARED_PLANS, GQA, PLAN_CHOICES, VANILLA, resolve_plan_choice


def register(sub) -> None:
    p = sub.add_parser(
        "bench", help="inference speed and memory: TTFT, TPOT, cache bytes vs vanilla and transformers",
        description="Measure every plan interleaved in one process (medians over repeats): KV cache bytes, "
        "time to first token, time per output token and decode tokens/s, with ratios to vanilla and to "
        "transformers' Qwen3ForCausalLM.generate on the same vanilla weights.")
    p.add_argument("--plans", default=",".join(COMPARED_PLANS),
                   help=f"comma-separated plans (from {', '.join(PLAN_CHOICES)}; PLAN+{GQA} for half the KV heads)")
    p.add_argument("--prompt-lens", default="256,1024,2048", help="comma-separated prompt lengths")
    p.add_argument("--batch-sizes", default="1,4", help="comma-separated batch sizes")
    p.add_argument("--new-tokens", type=int, default=16, help="decode steps per measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers Qwen3 baseline")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 avoids OpenMP stalls on a loaded machine)")
    p.add_argument("--json", dest="json_path", help="also write the rows as JSON here")
    p.add_argument("--plot", default=None, help="PNG of TTFT/TPOT ratios against prompt length")
    p.add_argument("--gpu-suite", action="store_true",
                   help="run the GPU suite instead (kernels vs SDPA, TTFT/TPOT at 8k-128k in bf16); needs CUDA")
    p.set_defaults(func=run)


def run(args) -> None:
    import torch

    if args.gpu_suite:
        from .gpu_suite import main as gpu_main

        return gpu_main([])
    from .inference import BenchShape, format_table, plot, run_inference_bench

    if args.threads:
        torch.set_num_threads(args.threads)

    plans = [p.strip() for p in args.plans.split(",") if p.strip()]
    for name in plans:
        try:
            resolve_plan_choice(name)
        except ValueError as e:
            raise ValueError(f"--plans: {e}") from None
    shape = BenchShape(num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                       num_attention_heads=args.heads, head_dim=args.head_dim, vocab_size=args.vocab)
    from tqdm import tqdm

    lens = [int(x) for x in args.prompt_lens.split(",")]
    batches = [int(x) for x in args.batch_sizes.split(",")]
    total = args.repeats * len(lens) * len(batches) * (len(set(plans) | {VANILLA}) + (0 if args.no_hf else 1))
    bar = tqdm(total=total, desc="bench", unit="run")

    def progress(msg):
        bar.set_postfix_str(msg, refresh=False)
        bar.update()

    rows = run_inference_bench(shape, plans, lens, batches, args.new_tokens, args.repeats, not args.no_hf,
                               args.device, getattr(torch, args.dtype), progress)
    bar.close()
    print(f"\nmodel: {vars(shape)}, {args.dtype} on {args.device} ({torch.get_num_threads()} threads), "
          f"{args.new_tokens} decode steps, "
          f"median of {args.repeats} interleaved repeats\n")
    print(format_table(rows))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, args.plot)
        print(f"\nplot: {args.plot}")
