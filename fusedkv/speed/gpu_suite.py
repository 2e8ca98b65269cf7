"""The GPU benchmark: decode-kernel throughput, then model TTFT / TPOT at 8k-128k in bf16.

    python -m fusedkv.speed.gpu_suite            # or: fusedkv bench --gpu-suite
    python -m fusedkv.speed.gpu_suite --dry-run  # every code path, tiny sizes, on CPU (Triton interpreter)

Part 1 (`fusedkv.speed.kernel_throughput`): one decode step of our Triton kernel against PyTorch's
flash SDPA, each timed case first checked against the fp32 reference. Part 2 builds a ~1B-parameter
model per plan (16 layers, d=2048, 16 heads of 128, bf16) and measures, with our lean generation loop
and a static cache: TTFT at 8k/32k/128k prompts (prefill skipping for the half-cache plans) and TPOT
(median of 32 decode steps), plus the paper's Fig. 5 GQA case (H_q=128, H_kv=2). Sized for < 8
minutes on one H200. Exit status 1 when a kernel check fails: a fast wrong kernel is a failure.
Kernel correctness over many shapes is tested in tests/kernels (CUDA, and the Triton interpreter on CPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

import torch

from ..config import FusedKVConfig
from ..generation import generate
from ..model import FusedKVForCausalLM
from ..plan import DECODE_TIMED_PLANS, VANILLA
from .kernel_throughput import failed_checks, format_markdown, kernel_suite


def _model(plan: str, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, max_len: int,
           device, dtype) -> FusedKVForCausalLM:
    cfg = FusedKVConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                        max_position_embeddings=max_len, kv_sharing=plan)
    with torch.device(device):
        model = FusedKVForCausalLM(cfg)
    return model.to(dtype).eval()


def model_suite(device="cuda", dtype=torch.bfloat16, lengths=(8192, 32768, 131072), new_tokens=32,
                layers=16, hidden=2048, heads=16, head_dim=128, gqa=(128, 2), gqa_length=32768) -> list[dict]:
    rows = []
    cases = [("MHA", heads, heads, lengths), ("GQA", gqa[0], gqa[1], (gqa_length,))]
    for case, h, kvh, lens in cases:
        for plan in DECODE_TIMED_PLANS:
            model = _model(plan, layers, hidden, h, kvh, head_dim, max(lens) + new_tokens, device, dtype)
            generate(model, torch.randint(1, 32000, (1, 64), device=device), 4, weight_layout="auto")  # warm-up
            for s in lens:
                ids = torch.randint(1, 32000, (1, s), device=device)
                if device != "cpu":
                    torch.cuda.reset_peak_memory_stats()
                r = generate(model, ids, new_tokens, weight_layout="auto")
                peak = torch.cuda.max_memory_allocated() if device != "cpu" else None
                mha = model.config.mha_kv_cache_bytes_per_token(next(model.parameters()).element_size())
                rows.append(dict(case=case, plan=plan, heads=h, kv_heads=kvh, prompt=s, ttft_s=r.ttft_s,
                                 tpot_s=r.tpot_s, cache_bytes=r.cache_bytes, peak_bytes=peak,
                                 cache_ratio=r.cache_bytes / (mha * (s + new_tokens))))
                print(json.dumps(rows[-1]), flush=True)
            del model
            gc.collect()
            if device != "cpu":
                torch.cuda.empty_cache()
    base = {(r["case"], r["prompt"]): r for r in rows if r["plan"] == VANILLA}
    for r in rows:
        b = base[(r["case"], r["prompt"])]
        r["ttft_ratio"], r["tpot_ratio"] = r["ttft_s"] / b["ttft_s"], r["tpot_s"] / b["tpot_s"]
    return rows


def format_model_table(rows: list[dict]) -> str:
    lines = ["| case | plan | prompt | cache GiB | cache vs MHA | peak GiB | TTFT ms | TTFT vs vanilla | "
             "TPOT ms | TPOT vs vanilla |", "|---" * 10 + "|"]
    for r in rows:
        peak = f"{r['peak_bytes'] / 2**30:.1f}" if r["peak_bytes"] else "n/a"
        lines.append(f"| {r['case']} H_q={r['heads']} H_kv={r['kv_heads']} | {r['plan']} | {r['prompt']} | "
                     f"{r['cache_bytes'] / 2**30:.2f} | {r['cache_ratio']:.2f} | {peak} | {r['ttft_s'] * 1e3:.1f} | "
                     f"{r['ttft_ratio']:.2f} | {r['tpot_s'] * 1e3:.2f} | {r['tpot_ratio']:.2f} |")
    return "\n".join(lines)


def main(argv=None, kernel=None) -> int:
    """`kernel`: another decode kernel to benchmark in place of ours (same signature), e.g. in tests."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU: exercises every code path")
    ap.add_argument("--skip-kernels", action="store_true", help="only the model part")
    ap.add_argument("--skip-model", action="store_true", help="only the kernel part")
    ap.add_argument("--tune", action="store_true", help="also sweep the kernel's BLOCK_N / num_warps")
    args = ap.parse_args(argv)
    start = time.time()
    from ..kernels import is_triton_available

    kernels = not args.skip_kernels and (kernel is not None or is_triton_available())
    if args.dry_run:
        if kernels and kernel is None and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            # The interpreter must be on before Triton is first imported (it decides at @jit time), and
            # `import fusedkv` already imports Triton (transformers -> torch._dynamo): rerun in a fresh process.
            cmd = [sys.executable, "-m", "fusedkv.speed.gpu_suite", *(sys.argv[1:] if argv is None else argv)]
            return subprocess.run(cmd, env={**os.environ, "TRITON_INTERPRET": "1"}).returncode
        device, dtype = torch.device("cpu"), torch.float32
    elif not torch.cuda.is_available():
        print("the GPU suite needs CUDA; use --dry-run to exercise it on CPU", file=sys.stderr)
        return 2
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
        print(f"# GPU suite on {torch.cuda.get_device_name()}\n")
    bad = []
    if kernels:
        kernel_rows = kernel_suite(device, dtype, args.dry_run, kernel=kernel, tune=args.tune)
        print(format_markdown(kernel_rows))
        bad = failed_checks(kernel_rows)
        if kernel is None:  # the paged kernel (vLLM block tables) next to the contiguous one
            from .paged_throughput import format_paged, paged_rows

            paged = paged_rows(device, dtype, args.dry_run)
            print("\n" + format_paged(paged))
            bad += failed_checks(paged)
        print(f"(kernels done in {time.time() - start:.0f}s, {len(bad)} failed checks)\n", flush=True)
    if not args.skip_model:
        if args.dry_run:
            rows = model_suite("cpu", torch.float32, lengths=(64, 128), new_tokens=4, layers=4, hidden=64, heads=4,
                               head_dim=16, gqa=(8, 2), gqa_length=64)
        else:
            rows = model_suite()
        print("\n## Model TTFT / TPOT (batch 1, static cache)\n")
        print(format_model_table(rows))
    print(f"\ntotal {time.time() - start:.0f}s")
    if bad:
        names = ", ".join(f"{r['kernel']} {r['shape']} B={r['B']} S={r['S']} (rel. err {r['rel_err']:.1e})"
                          for r in bad)
        print(f"error: {len(bad)} decode-kernel checks against the fp32 reference failed: {names}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
