"""Serving throughput on vLLM at a fixed KV-cache memory budget: what a half-size cache buys.

Three checkpoints with the same random weights where their parameters coincide (vanilla, fusedkv-lite,
fusedkv; head_dim 64) are served by vLLM's offline engine with the fusedkv plugin, each with the same
--kv-cache-memory, on many concurrent long requests. The budget is small enough that vanilla cannot
hold every request at once (memory-bound): the half plans fit twice the sequences in flight, which is
the throughput they can gain. Reported per plan: vLLM's cache blocks and maximum concurrency (as vLLM
logs it, for max-model-len tokens per request), requests/s and generated tokens/s; ratios to vanilla
from one process with the plans interleaved over --rounds rounds (medians).

Prefill skipping: long prompts with one new token each, Lite and FusedKV with and without vLLM's
--kv-sharing-fast-prefill (the layers after the last storage layer run on the sampled positions only).

Then single-stream decode, same weights: vLLM (one request), the project's own loop
(`fusedkv.generation.generate`, static half-size cache) and transformers' `generate`, tokens/s over
prompt + new tokens (one thread each).

vLLM runs in its own environment (scripts/install-vllm.sh), this script in the project's:

    python benchmarks/serving_throughput.py                          # ~10 minutes on 2 shared cores
    python benchmarks/serving_throughput.py --requests 32 --rounds 1 # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
PLANS = ("vanilla", "fusedkv-lite", "fusedkv")


def write_checkpoints(root: Path, args) -> dict[str, Path]:
    """Same seed for every plan: embeddings, MLPs, norms, Q/O and the storage layers' K/V coincide."""
    from fusedkv import FusedKVConfig, FusedKVForCausalLM

    out = {}
    for plan in PLANS:
        torch.manual_seed(0)
        cfg = FusedKVConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                            num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, head_dim=64,
                            max_position_embeddings=args.prompt_len + args.new_tokens, kv_sharing=plan,
                            bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = FusedKVForCausalLM(cfg).eval()
        out[plan] = root / plan
        model.save_pretrained(out[plan])
    return out


def vllm_run(vllm_python: str, models: list[Path], prompts: list[list[int]], work: Path, *extra: str) -> list[dict]:
    (work / "prompts.json").write_text(json.dumps(prompts))
    out = work / "vllm.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    cmd = [vllm_python, "-m", "fusedkv.serving.offline", "--models", *map(str, models), "--prompts",
           str(work / "prompts.json"), "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"vLLM run failed:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def throughput(vllm_python, ckpts, args, work) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(2, args.vocab, (args.requests, args.prompt_len), generator=g).tolist()
    order = [p for _ in range(args.rounds) for p in PLANS]
    results = vllm_run(vllm_python, [ckpts[p] for p in order], prompts, work, "--max-new-tokens",
                       str(args.new_tokens), "--kv-cache-memory", str(args.kv_cache_memory), "--max-num-seqs",
                       str(args.requests), "--dtype", "float32")
    rows = []
    for plan in PLANS:
        runs = [r for p, r in zip(order, results) if p == plan]
        elapsed = statistics.median(r["elapsed_s"] for r in runs)
        rows.append({"plan": plan, "num_blocks": runs[0]["num_blocks"], "kv_cache_tokens": runs[0]["kv_cache_tokens"],
                     "max_concurrency": runs[0]["max_concurrency"], "elapsed_s": elapsed,
                     "requests_per_s": args.requests / elapsed,
                     "tokens_per_s": runs[0]["generated_tokens"] / elapsed,
                     "rounds_s": [r["elapsed_s"] for r in runs]})
    base = rows[0]
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
    return rows


def prefill_skipping(vllm_python, ckpts, args, work) -> list[dict]:
    """Prefill-bound work (long prompts, one new token) with and without vLLM's kv_sharing_fast_prefill."""
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(2, args.vocab, (args.prefill_requests, args.prompt_len + args.new_tokens - 1),
                            generator=g).tolist()
    plans = [p for p in PLANS if p != "vanilla"]
    order = [p for _ in range(args.rounds) for p in plans]
    timed = {}
    for mode, extra in (("full", ()), ("skipping", ("--fast-prefill",))):
        runs = vllm_run(vllm_python, [ckpts[p] for p in order], prompts, work, "--max-new-tokens", "1",
                        "--kv-cache-memory", str(4 * args.kv_cache_memory), "--dtype", "float32", *extra)
        for plan in plans:
            timed[plan, mode] = statistics.median(r["elapsed_s"] for p, r in zip(order, runs) if p == plan)
    return [{"plan": p, "full_s": timed[p, "full"], "skipping_s": timed[p, "skipping"],
             "speedup": timed[p, "full"] / timed[p, "skipping"]} for p in plans]


@torch.inference_mode()
def single_stream(vllm_python, ckpts, args, work) -> list[dict]:
    from transformers import AutoModelForCausalLM

    import fusedkv  # noqa: F401  (registers the model with transformers)
    from fusedkv.generation import generate

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(2, args.vocab, (1, args.single_prompt_len), generator=g)
    n = args.single_new_tokens
    vllm = vllm_run(vllm_python, [ckpts[p] for p in PLANS], prompt.tolist(), work, "--max-new-tokens", str(n),
                    "--kv-cache-memory", str(args.kv_cache_memory), "--dtype", "float32")
    rows = []
    for plan, v in zip(PLANS, vllm):
        model = AutoModelForCausalLM.from_pretrained(ckpts[plan]).eval()
        generate(model, prompt, 4, weight_layout="auto")  # warm-up, and the batch-1 layout
        t = time.perf_counter()
        ours = generate(model, prompt, n, weight_layout="auto")
        t_ours = time.perf_counter() - t
        model = AutoModelForCausalLM.from_pretrained(ckpts[plan]).eval()  # fresh, unpacked
        model.generate(prompt, max_new_tokens=4, do_sample=False)
        t = time.perf_counter()
        hf = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        t_hf = time.perf_counter() - t
        same = v["rows"][0]["tokens"] == ours.tokens[0, prompt.shape[1]:].tolist() == hf[0, prompt.shape[1]:].tolist()
        rows.append({"plan": plan, "vllm_tok_s": n / v["elapsed_s"], "fusedkv_loop_tok_s": n / t_ours,
                     "transformers_generate_tok_s": n / t_hf, "same_tokens": same})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256, help="hidden size; heads = hidden / 64, head_dim 64")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--kv-cache-memory", type=int, default=None,
                   help="bytes (default: room for 8 vanilla sequences of prompt + new tokens)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prefill-requests", type=int, default=16)
    p.add_argument("--single-prompt-len", type=int, default=32)
    p.add_argument("--single-new-tokens", type=int, default=128)
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args()
    from fusedkv.serving.command import check_vllm_environment, find_vllm_python

    vllm_python = find_vllm_python(args.vllm_python)
    check_vllm_environment(vllm_python)
    if args.kv_cache_memory is None:  # fp32 K and V per layer per token, 8 full-length vanilla sequences
        per_token = 2 * args.layers * args.hidden * 4
        args.kv_cache_memory = 8 * (args.prompt_len + args.new_tokens) * per_token
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ckpts = write_checkpoints(work / "ckpts", args)
        tp = throughput(vllm_python, ckpts, args, work)
        pf = prefill_skipping(vllm_python, ckpts, args, work)
        ss = single_stream(vllm_python, ckpts, args, work)
    print(f"## vLLM serving throughput (measured on a shared 2-core CPU machine; ratios from one interleaved run)\n\n"
          f"{args.requests} requests x ({args.prompt_len} prompt + {args.new_tokens} new tokens), KV-cache memory "
          f"{args.kv_cache_memory / 2**20:.1f} MiB, {args.layers} layers, hidden {args.hidden}, head_dim 64, fp32, "
          f"eager, {args.rounds} round(s), median\n")
    print("| plan | cache blocks | max concurrency (vLLM) | requests/s | tokens/s | vs vanilla |")
    print("|---|---|---|---|---|---|")
    for r in tp:
        print(f"| {r['plan']} | {r['num_blocks']} | {r['max_concurrency']:.2f} | {r['requests_per_s']:.2f} | "
              f"{r['tokens_per_s']:.0f} | {r['speedup']:.2f}x |")
    print(f"\n## Prefill skipping ({args.prefill_requests} prompts of {args.prompt_len + args.new_tokens - 1} tokens, "
          "1 new token each; vLLM --kv-sharing-fast-prefill)\n")
    print("| plan | full prefill (s) | upper layers on sampled positions only (s) | speed-up |\n|---|---|---|---|")
    for r in pf:
        print(f"| {r['plan']} | {r['full_s']:.2f} | {r['skipping_s']:.2f} | {r['speedup']:.2f}x |")
    print(f"\n## Single-stream decode ({args.single_prompt_len}-token prompt, {args.single_new_tokens} new tokens, "
          "1 thread, tokens/s including prefill)\n")
    print("| plan | vLLM | fusedkv loop | transformers generate | same tokens |\n|---|---|---|---|---|")
    for r in ss:
        print(f"| {r['plan']} | {r['vllm_tok_s']:.0f} | {r['fusedkv_loop_tok_s']:.0f} | "
              f"{r['transformers_generate_tok_s']:.0f} | {r['same_tokens']} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "throughput": tp, "prefill_skipping": pf,
                                              "single_stream": ss}, indent=1))


if __name__ == "__main__":
    main()
