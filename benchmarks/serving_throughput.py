"""Serving throughput on vLLM at a fixed KV-cache memory budget: what a half-size cache buys.

Three checkpoints with the same random weights where their parameters coincide (vanilla, fusedkv-lite,
fusedkv; head_dim 64) are served by vLLM's offline engine with the fusedkv plugin, each with the same
--kv-cache-memory, on many concurrent long requests. The budget is small enough that vanilla cannot
hold every request at once (memory-bound): the half plans fit twice the sequences in flight, which is
the throughput they can gain.

How it is timed (the same for every table): one engine per plan, kept alive, each warmed up on the
same batch shape; then --rounds rounds (at least 5), round r running the engines in an order rotated
by r. Every round gives a ratio to vanilla of that same round; the table prints each round's ratio and
their median, and the JSON (--out) keeps every per-round time.

Three workloads (`--workload`), all at a KV budget of 8 vanilla sequences of full length:
  * short (the first one measured): 32 requests x (128 prompt + 128 new tokens);
  * long: 32 requests x (1024 prompt + 128 new tokens), the issue's "many long requests": vanilla's budget
    admits 8 full sequences, the half plans' 16, and prefill is a large part of the work.
  * memory-bound: 16 requests x (256 prompt + 256 new tokens) on a larger model served in bfloat16 (hidden
    1024, GQA 16/4 heads: 124 MiB of weights read by every decode step). The two workloads above run a 17 MiB
    f32 model whose step cost grows with the batch (per-sequence work dominates it); here reading the weights
    dominates, so a step of 16 sequences costs little more than a step of 8: the regime in which serving is
    memory-bound, and twice the sequences in flight is what a half-size cache buys.
In each, Lite and FusedKV run twice: as they are, and with vLLM's --kv-sharing-fast-prefill (the layers
after the last storage layer run only on the positions whose logits are sampled, paper Sec. 3.3), each
a row of its own against the same vanilla rounds. vLLM's scheduler is observed in the last round
(engine steps, preemptions, mean requests per decode step) and printed beside the rates.

Then single-stream decode, same weights: vLLM (one request; its engines interleaved as above), the
project's own loop (`fusedkv.generation.generate`) and transformers' `generate`, each warmed up, the
plan x engine pairs rotated per round (one thread each). With --prefill-skipping, also long prompts with
one new token, Lite and FusedKV with and without vLLM's --kv-sharing-fast-prefill.

vLLM runs in its own environment (scripts/install-vllm.sh), this script in the project's:

    OMP_NUM_THREADS=1 python benchmarks/serving_throughput.py --out docs/serving_throughput.json
    OMP_NUM_THREADS=1 python benchmarks/serving_throughput.py --workload long --skip-single-stream \
        --out docs/serving_throughput_long.json
    OMP_NUM_THREADS=1 python benchmarks/serving_throughput.py --workload memory-bound --skip-single-stream \
        --out docs/serving_throughput_memory_bound.json
    OMP_NUM_THREADS=1 python benchmarks/serving_throughput.py --requests 16 --prompt-len 64 --new-tokens 64
    OMP_NUM_THREADS=1 python benchmarks/serving_throughput.py --workload memory-bound --skip-single-stream \
        --checkpoints vanilla=V,fusedkv-lite=L,fusedkv=F   # a real model's three plans, its shape and dtype
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
FAST_PREFILL = ("fusedkv-lite", "fusedkv")  # plans whose upper layers can skip prompt positions
# 17 MiB of f32 weights per decode step
SMALL_MODEL = {"layers": 4, "hidden": 256, "kv_heads": 4, "vocab": 4096, "dtype": "float32"}
WORKLOADS = {"short": {"requests": 32, "prompt_len": 128, "new_tokens": 128, **SMALL_MODEL},
             "long": {"requests": 32, "prompt_len": 1024, "new_tokens": 128, **SMALL_MODEL},
             # bf16 as models are served, GQA 16/4 heads: 124 MiB of weights read by every decode step, whose
             # cost then grows little from 8 to 16 sequences (serving_step_profile.py --workload memory-bound).
             "memory-bound": {"requests": 16, "prompt_len": 256, "new_tokens": 256, "layers": 4, "hidden": 1024,
                              "kv_heads": 4, "vocab": 16384, "dtype": "bfloat16"}}


def write_checkpoints(root: Path, args) -> dict[str, Path]:
    """Same seed for every plan: embeddings, MLPs, norms, Q/O and the storage layers' K/V coincide."""
    from fusedkv import FusedKVConfig, FusedKVForCausalLM

    out = {}
    for plan in PLANS:
        torch.manual_seed(0)
        cfg = FusedKVConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                            num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, head_dim=64,
                            num_key_value_heads=args.kv_heads,
                            max_position_embeddings=args.prompt_len + args.new_tokens, kv_sharing=plan,
                            bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = FusedKVForCausalLM(cfg).eval()
        out[plan] = root / plan
        model.save_pretrained(out[plan])
    return out


def given_checkpoints(spec: str, args) -> dict[str, Path]:
    """`--checkpoints vanilla=DIR,fusedkv-lite=DIR,fusedkv=DIR`: the plans of one real model (one shape); the
    model options (layers, heads, vocabulary, dtype unless given) are read from vanilla's config."""
    given = [f"--{n.replace('_', '-')}" for n in ("layers", "hidden", "kv_heads", "vocab") if getattr(args, n)]
    if given:
        sys.exit(f"--checkpoints takes the model's shape from its config: leave out {', '.join(given)}")
    ckpts = {plan: Path(d) for plan, d in (x.split("=", 1) for x in spec.split(","))}
    if sorted(ckpts) != sorted(PLANS):
        sys.exit(f"--checkpoints needs one directory for each of {', '.join(PLANS)} (got {', '.join(ckpts)})")
    cfg = json.loads((ckpts["vanilla"] / "config.json").read_text())
    args.layers, args.hidden, args.vocab = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    args.heads, args.kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    args.head_dim = cfg.get("head_dim") or args.hidden // args.heads
    args.dtype = args.dtype or cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return ckpts


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


def rotated(items: list, r: int) -> list:
    return items[r % len(items):] + items[:r % len(items)]


def ratio_rows(plans, times: dict[str, list[float]], work: dict[str, float]) -> list[dict]:
    """Per plan: per-round rate (work / seconds), per-round ratio to vanilla's same round, medians."""
    rows = []
    for plan in plans:
        rates = [work[plan] / t for t in times[plan]]
        ratios = [work[plan] / t / (work["vanilla"] / tv) for t, tv in zip(times[plan], times["vanilla"])]
        rows.append({"plan": plan, "rounds_s": times[plan], "rate_per_round": rates,
                     "median_rate": statistics.median(rates), "ratio_per_round": ratios,
                     "median_ratio": statistics.median(ratios)})
    return rows


def _runs(items: list[str]) -> list[tuple[str, int]]:
    """Consecutive equal items as (item, count)."""
    out: list[tuple[str, int]] = []
    for x in items:
        if out and out[-1][0] == x:
            out[-1] = (x, out[-1][1] + 1)
        else:
            out.append((x, 1))
    return out


def throughput(vllm_python, ckpts, args, work) -> list[dict]:
    """Rows for the plans, then for the half plans with fast prefill ("<plan> +fast-prefill"), all engines
    rotated together in one process, every ratio against vanilla's same round."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(2, args.vocab, (args.requests, args.prompt_len), generator=g).tolist()
    fast = [] if args.no_fast_prefill else list(FAST_PREFILL)
    extra = ["--fast-prefill-models", *(str(ckpts[p]) for p in fast)] if fast else []
    results = vllm_run(vllm_python, [ckpts[p] for p in PLANS], prompts, work, "--max-new-tokens",
                       str(args.new_tokens), "--kv-cache-memory", str(args.kv_cache_memory), "--max-num-seqs",
                       str(args.requests), "--dtype", args.dtype, "--max-model-len",
                       str(args.prompt_len + args.new_tokens), "--rounds", str(args.rounds), *extra)
    names = [*PLANS, *(p + " +fast-prefill" for p in fast)]
    by_name = dict(zip(names, results))
    tokens = {n: r["generated_tokens"] for n, r in by_name.items()}
    rows = ratio_rows(names, {n: r["elapsed_s"] for n, r in by_name.items()}, tokens)
    # The same ratios by the engine process's CPU seconds: on a shared machine, where wall time includes
    # waiting for a core, the steadier estimate of what an idle machine would show (not the target itself).
    by_cpu = ratio_rows(names, {n: r["cpu_s"] for n, r in by_name.items()}, tokens)
    for row, cpu in zip(rows, by_cpu):
        r = by_name[row["plan"]]
        row.update(cpu_s=cpu["rounds_s"], cpu_ratio_per_round=cpu["ratio_per_round"],
                   median_cpu_ratio=cpu["median_ratio"])
        row.update(num_blocks=r["num_blocks"], kv_cache_tokens=r["kv_cache_tokens"], attention=r.get("attention"),
                   processor=r.get("processor"),
                   max_concurrency=r["max_concurrency"], schedule=r["schedule"],
                   same_tokens_as_without_fast_prefill=(
                       r["rows"] == by_name[row["plan"].split()[0]]["rows"] if r["fast_prefill"] else None))
    return rows


def prefill_skipping(vllm_python, ckpts, args, work) -> list[dict]:
    """Prefill-bound work (long prompts, one new token) with and without vLLM's kv_sharing_fast_prefill."""
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(2, args.vocab, (args.prefill_requests, args.prompt_len + args.new_tokens - 1),
                            generator=g).tolist()
    plans = [p for p in PLANS if p != "vanilla"]
    timed = {}
    for mode, extra in (("full", ()), ("skipping", ("--fast-prefill",))):
        runs = vllm_run(vllm_python, [ckpts[p] for p in plans], prompts, work, "--max-new-tokens", "1",
                        "--kv-cache-memory", str(4 * args.kv_cache_memory), "--dtype", args.dtype,
                        "--rounds", str(args.rounds), *extra)
        for plan, r in zip(plans, runs):
            timed[plan, mode] = r["elapsed_s"]
    return [{"plan": p, "full_s": timed[p, "full"], "skipping_s": timed[p, "skipping"],
             "median_speedup": statistics.median(f / s for f, s in zip(timed[p, "full"], timed[p, "skipping"]))}
            for p in plans]


@torch.inference_mode()
def single_stream(vllm_python, ckpts, args, work) -> dict:
    from transformers import AutoModelForCausalLM

    import fusedkv  # noqa: F401  (registers the model with transformers)
    from fusedkv.generation import generate

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(2, args.vocab, (1, args.single_prompt_len), generator=g)
    n = args.single_new_tokens
    vllm = dict(zip(PLANS, vllm_run(vllm_python, [ckpts[p] for p in PLANS], prompt.tolist(), work,
                                    "--max-new-tokens", str(n), "--kv-cache-memory", str(args.kv_cache_memory),
                                    "--dtype", args.dtype, "--rounds", str(args.rounds))))
    # The project's loop (packed for batch 1) and transformers' generate (a fresh, unpacked model).
    engines = {}
    for plan in PLANS:
        dtype = getattr(torch, args.dtype)  # the dtype vLLM serves (--dtype), for every engine
        packed = AutoModelForCausalLM.from_pretrained(ckpts[plan], dtype=dtype).eval()
        engines[plan, "fusedkv_loop"] = lambda m=packed, k=None: generate(m, prompt, k or n, weight_layout="auto")
        plain = AutoModelForCausalLM.from_pretrained(ckpts[plan], dtype=dtype).eval()
        engines[plan, "transformers"] = lambda m=plain, k=None: m.generate(
            prompt, max_new_tokens=k or n, min_new_tokens=k or n, do_sample=False)
    tokens = {}
    for key, run in engines.items():  # warm-up (and the packed layout); the tokens to compare
        out = run(k=n)
        tokens[key] = (out.tokens if hasattr(out, "tokens") else out)[0, prompt.shape[1]:].tolist()
    times = {key: [] for key in engines}
    for r in range(args.rounds):
        for key in rotated(list(engines), r):
            t = time.perf_counter()
            engines[key]()
            times[key].append(time.perf_counter() - t)
    rows = []
    for plan in PLANS:
        row = {"plan": plan, "same_tokens": vllm[plan]["rows"][0]["tokens"] == tokens[plan, "fusedkv_loop"]
               == tokens[plan, "transformers"]}
        for name, secs in (("vllm", vllm[plan]["elapsed_s"]), ("fusedkv_loop", times[plan, "fusedkv_loop"]),
                           ("transformers", times[plan, "transformers"])):
            row[name + "_tok_s_per_round"] = [n / s for s in secs]
            row[name + "_tok_s"] = statistics.median(n / s for s in secs)
        rows.append(row)
    vllm_ratios = ratio_rows(PLANS, {p: vllm[p]["elapsed_s"] for p in PLANS}, {p: n for p in PLANS})
    return {"rows": rows, "vllm_vs_vanilla": vllm_ratios}


def fmt_rounds(xs) -> str:
    return ", ".join(f"{x:.2f}" for x in xs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="short",
                   help="request and model preset (short: 32 x (128 + 128), long: 32 x (1024 + 128), both on a "
                        "4-layer hidden-256 model; memory-bound: 16 x (256 + 256) on a 4-layer hidden-1024 GQA "
                        "model); the options below override it")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None, help="hidden size; heads = hidden / 64, head_dim 64")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA below hidden / 64)")
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--dtype", default=None, help="weights and KV cache: float32 or bfloat16")
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--no-fast-prefill", action="store_true",
                   help="leave out the half plans' engines with vLLM's --kv-sharing-fast-prefill")
    p.add_argument("--skip-single-stream", action="store_true", help="only the throughput table")
    p.add_argument("--kv-cache-memory", type=int, default=None,
                   help="bytes (default: room for 8 vanilla sequences of prompt + new tokens)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per engine, order rotated (at least 5)")
    p.add_argument("--prefill-skipping", action="store_true", help="also time vLLM's --kv-sharing-fast-prefill")
    p.add_argument("--prefill-requests", type=int, default=16)
    p.add_argument("--single-prompt-len", type=int, default=32)
    p.add_argument("--single-new-tokens", type=int, default=128)
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--checkpoints", default=None, metavar="vanilla=DIR,fusedkv-lite=DIR,fusedkv=DIR",
                   help="serve these checkpoints of one model (a real one) instead of random ones of the workload's "
                        "shape; its shape and dtype come from vanilla's config")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args()
    if args.rounds < 5:
        p.error("--rounds must be at least 5: a median of fewer rotated rounds is not one to report")
    given = given_checkpoints(args.checkpoints, args) if args.checkpoints else None
    for name, value in WORKLOADS[args.workload].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if given is None:
        args.heads, args.head_dim = args.hidden // 64, 64
    from fusedkv.serving.command import check_vllm_environment, find_vllm_python

    vllm_python = find_vllm_python(args.vllm_python)
    check_vllm_environment(vllm_python)
    if args.kv_cache_memory is None:  # K and V per layer per token, 8 full-length vanilla sequences
        per_token = 2 * args.layers * args.kv_heads * args.head_dim * torch.finfo(getattr(torch, args.dtype)).bits // 8
        args.kv_cache_memory = 8 * (args.prompt_len + args.new_tokens) * per_token
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ckpts = given or write_checkpoints(work / "ckpts", args)
        tp = throughput(vllm_python, ckpts, args, work)
        pf = prefill_skipping(vllm_python, ckpts, args, work) if args.prefill_skipping else None
        ss = None if args.skip_single_stream else single_stream(vllm_python, ckpts, args, work)
    load = (load, os.getloadavg())
    print(f"## vLLM serving throughput at a fixed KV budget ({args.workload} workload)\n\n"
          f"Measured on a shared 2-core CPU machine (load "
          f"average {load[0][0]:.1f} at the start, {load[1][0]:.1f} at the end): absolute figures are rough. "
          f"{args.requests} requests x ({args.prompt_len} prompt + {args.new_tokens} new tokens), KV-cache memory "
          f"{args.kv_cache_memory / 2**20:.1f} MiB, {args.checkpoints or 'random weights'}: {args.layers} layers, "
          f"hidden {args.hidden}, {args.heads} query / {args.kv_heads} key-value heads of {args.head_dim}, "
          f"vocabulary {args.vocab}, {args.dtype}, "
          f"eager; every engine warmed up, {args.rounds} rounds in rotated order, ratios to vanilla's same round\n")
    print("| plan | cache blocks | max concurrency (vLLM) | requests per decode step (mean) | preemptions | "
          "generated tokens/s (median) | vs vanilla per round | median | by CPU time: per round | median |"
          "\n|---|---|---|---|---|---|---|---|---|---|")
    for r in tp:
        sched = r["schedule"]
        print(f"| {r['plan']} | {r['num_blocks']} | {r['max_concurrency']:.2f} | {sched['mean_decode_batch']:.1f} | "
              f"{sched['preemptions']} | {r['median_rate']:.0f} | {fmt_rounds(r['ratio_per_round'])} | "
              f"{r['median_ratio']:.2f}x | {fmt_rounds(r['cpu_ratio_per_round'])} | {r['median_cpu_ratio']:.2f}x |")
    for r in tp:
        if r.get("attention"):
            paths = ", ".join(f"{n}x {p}" for p, n in _runs(r["attention"]))
            print(f"\n{r['plan']} on {r['processor']}: attention paths by layer: {paths}", end="")
    print()
    for r in tp:
        if r["same_tokens_as_without_fast_prefill"] is False:
            print(f"\nwarning: {r['plan']} generated other tokens than without fast prefill")
    if pf:
        print(f"\n## Prefill skipping ({args.prefill_requests} prompts of {args.prompt_len + args.new_tokens - 1} "
              "tokens, 1 new token each; vLLM --kv-sharing-fast-prefill)\n")
        print("| plan | full prefill per round (s) | skipping per round (s) | median speed-up |\n|---|---|---|---|")
        for r in pf:
            print(f"| {r['plan']} | {fmt_rounds(r['full_s'])} | {fmt_rounds(r['skipping_s'])} | "
                  f"{r['median_speedup']:.2f}x |")
    if ss is None:
        ss = {}
    else:
        print(f"\n## Single-stream decode ({args.single_prompt_len}-token prompt, {args.single_new_tokens} new tokens, "
              f"1 thread, tokens/s including prefill, median of {args.rounds} rounds)\n")
        print("| plan | vLLM | vLLM vs vanilla per round | median | fusedkv loop | transformers generate | "
              "same tokens |\n|---|---|---|---|---|---|---|")
    for r, v in zip(ss.get("rows", []), ss.get("vllm_vs_vanilla", [])):
        print(f"| {r['plan']} | {r['vllm_tok_s']:.0f} | {fmt_rounds(v['ratio_per_round'])} | {v['median_ratio']:.2f}x "
              f"| {r['fusedkv_loop_tok_s']:.0f} | {r['transformers_tok_s']:.0f} | {r['same_tokens']} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "load_average": load, "throughput": tp,
                                              "prefill_skipping": pf, "single_stream": ss or None}, indent=1) + "\n")


if __name__ == "__main__":
    main()
