"""CPU decode next to llama.cpp: TTFT and TPOT of fusedkv's plans at every weight and KV precision, and of
llama.cpp on the same vanilla weights, interleaved in one process, with each row's effective read
bandwidth next to the streaming ceiling. Also the kernel table and the quality table behind
`fusedkv.engine.precision`.

    python benchmarks/cpu_decode.py                    # bench model, threads 1,2, prompts 512,2048, batch 1 (+4)
    python benchmarks/cpu_decode.py --llamacpp-src ~/.cache/fusedkv/llama_cpp_python-0.3.36.tar.gz
    python benchmarks/cpu_decode.py --kernels          # one-step weight products per format and row count
    python benchmarks/cpu_decode.py --attention --prompt-lens 2048,16384   # the native attention per cache kind
    python benchmarks/cpu_decode.py --quality RUN/final --weights float32,bfloat16,int8,int4 --kv float32
                                                       # logits vs f32 and perplexity per precision
    python benchmarks/cpu_decode.py --overhead --kv float32  # one step's CPU time: products, rest, floor
    python benchmarks/cpu_decode.py --plans vanilla --weights int4 --kv half --llama-rows q4_0/f16,q4_k_m/f16
                                                       # int4 against llama.cpp's Q4_0 and Q4_K_M
    python benchmarks/cpu_decode.py --long 8192,32768 --kv half --llama-rows f32/f16   # TPOT after long caches
    python benchmarks/cpu_decode.py --kivi --plans vanilla,fusedkv --threads 1 --prompt-lens 2048,32768 \\
        --steps 8 --repeats 5                          # native step over KIVI-4 / KIVI-2 vs the bf16 cache
    python benchmarks/cpu_decode.py --prefill --plans vanilla --weights float32,int4   # where prefill time goes
    python benchmarks/cpu_decode.py --model HF_DIR_OR_GGUF --gguf FILE.gguf --text a.txt,b.txt --llama-rows \\
        f16/f16,q8_0/f16,q4_0/f16,q4_k_m/f16 --weights float32,half,int8,int4 --json out.json   # a real model

Rows: `PLAN w=WEIGHTS kv=KV` for fusedkv (f32, bf16/f16, int8, int4 weights; f32 or 16-bit cache), and
`llama.cpp w=TYPE kv=TYPE` (f32, f16, q8_0 GGUF converted by llama.cpp's own converter, q4_0 / q4_k_m from
its quantizer; f32 or f16 KV) when llama-cpp-python is installed (its source distribution, which holds the
converter, is fetched from the package registry when not given; `fusedkv.speed.llamacpp`).
fusedkv rows decode as `fusedkv.generation.generate` does by default (the native step where it covers
the model); `--step both` adds each row again decoded module by module (`... modules`).
Every (threads, prompt, batch) cell runs all rows round-robin, the order rotated per repeat, and
reports medians; ratios (medians of the per-round ratios) are to llama.cpp with the same weight and KV
kinds (int4: both Q4 files). llama.cpp runs one
sequence, so batch 4 compares fusedkv rows among themselves. GB/s = (weight bytes + KV bytes read)
per step / TPOT; the ceiling is `torch.sum` over as many bytes (as `benchmarks/decode_layout.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from fusedkv.cache import StaticKVCache
from fusedkv.engine import precision, select_runtime
from fusedkv.engine.precision import (
    half_dtype,
    head_format,
    kv_dtype_for,
    reduce_precision,
    weight_format,
    weight_nbytes,
)
from fusedkv.generation import generate
from fusedkv.kernels import cpu_gemv, native
from fusedkv.speed.inference import HF, BenchShape, build_models
from fusedkv.utils import processor

INT4_RULE = precision.INT4_RULE  # --int4-rule: the scale rule of every int4 model this script builds
SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int8": "int8", "int4": "int4"}


def weight_spec(spec: str) -> str:
    """A --weights entry normalised: FORMAT (the LM head in its default format: int8 under int4) or
    FORMAT@HEAD (the LM head in HEAD, e.g. int4@int4 for every product at int4)."""
    fmt, _, head = spec.partition("@")
    fmt = weight_format(fmt)
    return fmt if not head or head_format(fmt, head) == head_format(fmt) else f"{fmt}@{weight_format(head)}"


def reduced(model, spec: str):
    """`model` itself for f32, else a reduced copy of it for a `weight_spec`."""
    if spec == "float32":
        return model
    fmt, _, head = spec.partition("@")
    return reduce_precision(_copy(model), fmt, head or None, int4_rule=INT4_RULE)


def short(spec: str) -> str:
    fmt, _, head = spec.partition("@")
    return SHORT[fmt] + (f"@{SHORT[head]}" if head else "")


# ---- fusedkv rows ------------------------------------------------------------------------------------
def our_rows(plans: list[str], weights: list[str], kvs: list[str], max_len: int,
             shape: BenchShape | None = None) -> dict[str, dict]:
    """label -> dict(model, kv_dtype, weight_bytes): one model per (plan, weight format)."""
    base = build_models(shape or BenchShape(), plans, max_len, "cpu", torch.float32, include_hf=True)
    rows = {}
    for plan in plans:
        for fmt in weights:
            model = reduced(base[plan], fmt)
            # An f32 cache is compared for f32 weights only (llama.cpp's 16-bit weights run an f16 cache).
            for kv in kvs if fmt == "float32" else [k for k in kvs if k != "float32"] or kvs:
                kv_dtype = torch.float32 if kv == "float32" else half_dtype()
                label = f"{plan} w={short(fmt)} kv={SHORT[str(kv_dtype).removeprefix('torch.')]}"
                rows[label] = dict(model=model, kv_dtype=kv_dtype, weight_bytes=weight_nbytes(model))
    return rows, base.get(HF)  # no transformers twin for another architecture (--architecture)


def _copy(model):
    import copy

    return copy.deepcopy(model)


def run_ours(row: dict, ids: torch.Tensor, new_tokens: int) -> dict:
    kv_dtype = row["kv_dtype"]

    def cache(config, batch, max_len, dtype, device):
        return StaticKVCache(config, batch, max_len, kv_dtype, device)

    r = generate(row["model"], ids, new_tokens, weight_layout="auto", cache_factory=cache,
                 native_step=row.get("native_step", True))
    return dict(ttft=r.ttft_s, tpot=r.tpot_s)


def kv_bytes_per_step(model, context: int, batch: int, elem: float) -> float:
    c = model.config
    return c.plan.elements_read_per_token() * c.num_key_value_heads * c.head_dim * context * batch * elem


# ---- llama.cpp rows ----------------------------------------------------------------------------------
def llama_models(hf_model, src: str | None, workdir: Path, types: list[str]) -> dict[str, Path]:
    """GGUF files of the bench model's vanilla weights: the converter's types, and Q4_0 / Q4_K_M from
    llama.cpp's quantizer. Without `src`, the sdist is fetched from the package registry (once)."""
    from fusedkv.speed.llamacpp import convert_to_gguf, export_hf_checkpoint, find_converter

    root = find_converter(src, workdir, fetch=True)
    hf_dir = export_hf_checkpoint(hf_model, workdir / "hf")
    return {t: convert_to_gguf(hf_dir, workdir / f"bench-{t}.gguf", t, root) for t in types}


def llama_runners(llama: dict[str, Path], specs: str, n_ctx: int, threads: int, n_batch: int = 512) -> dict:
    """label -> (LlamaCppRunner, weight type, KV type, weight bytes per step) for each GGUF/KV spec."""
    from fusedkv.speed.llamacpp import LlamaCppRunner, gguf_weight_nbytes

    runners = {}
    for spec in specs.split(","):
        ty, kv = spec.split("/")
        runners[f"llama.cpp w={ty} kv={kv}"] = (LlamaCppRunner(llama[ty], n_ctx, threads, kv, n_batch=n_batch), ty,
                                                kv, gguf_weight_nbytes(llama[ty]))
    return runners


# ---- the interleaved run -----------------------------------------------------------------------------
def streaming_ceiling(nbytes: int, repeats: int = 21) -> float:
    x = torch.randn(nbytes // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def run(args) -> list[dict]:
    threads = [int(t) for t in args.threads.split(",")]
    prompts = [int(p) for p in args.prompt_lens.split(",")]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    max_len = max(prompts) + args.new_tokens + 8
    weights = [weight_spec(w) for w in args.weights.split(",")]
    kvs = ["float32" if k in ("float32", "f32") else "half" for k in args.kv.split(",")]
    ours, hf = our_rows(args.plans.split(","), weights, kvs, max_len, _shape(args))
    if args.step != "native":  # the module-by-module loop, as rows of their own ("both") or instead
        modules = {f"{name} modules": dict(row, native_step=False) for name, row in ours.items()}
        ours = {**(ours if args.step == "both" else {}), **modules}
    llama = setup_llama(args, hf) if hf is not None else {}  # no HF twin for --architecture
    del hf
    vocab = BenchShape().vocab_size
    out = []
    gen = torch.Generator().manual_seed(0)
    for t in threads:
        torch.set_num_threads(t)
        runners = llama_runners(llama, args.llama_rows, max_len, t) if llama else {}
        names = list(ours) + list(runners)
        for name in names:  # warm-up: first calls allocate and tune
            ids = torch.randint(1, vocab, (1, 32), generator=gen)
            _one(name, ours, runners, ids, 4)
        ceiling = streaming_ceiling(max(r["weight_bytes"] for r in ours.values()))
        for b in batches:
            for s in prompts:
                if b > 1 and s != min(prompts):
                    continue  # batch > 1: the shortest prompt only (it is a no-slowdown check)
                cell_names = [n for n in names if b == 1 or n in ours]
                samples: dict[str, list[dict]] = {n: [] for n in cell_names}
                for r in range(args.repeats):
                    ids = torch.randint(1, vocab, (b, s), generator=gen)
                    shift = r % len(cell_names)
                    for name in cell_names[shift:] + cell_names[:shift]:
                        samples[name].append(_one(name, ours, runners, ids, args.new_tokens))
                    print(f"threads {t} batch {b} prompt {s}: repeat {r + 1}/{args.repeats}", file=sys.stderr)
                for name, runs in samples.items():
                    out.append(make_row(name, runs, ours, runners, t, b, s, s + args.new_tokens // 2, ceiling))
        for runner, *_ in runners.values():
            runner.close()
    return out


def _shape(args) -> BenchShape:
    """The bench model, as a sliding-window hybrid with --sliding-window (three window layers, then a full one),
    with --architecture's config fields (MoE, MLA) on every layer."""
    return BenchShape(sliding_window=args.sliding_window, architecture=json.loads(args.architecture or "{}"))


def setup_llama(args, hf) -> dict[str, Path]:
    """The GGUF files of --llama-rows, or {} (with the reason on stderr) when llama.cpp is not installed or
    --no-llama is given."""
    from fusedkv.speed.llamacpp import available

    if args.no_llama:
        return {}
    why = available()
    if why:
        print(why, file=sys.stderr)
        return {}
    types = list(dict.fromkeys(spec.split("/")[0] for spec in args.llama_rows.split(",")))
    return llama_models(hf, args.llamacpp_src, Path(tempfile.mkdtemp(prefix="fusedkv-llamacpp-")), types)


def make_row(name, runs, ours, runners, threads, batch, prompt, context, ceiling) -> dict:
    """A table row: medians of the rounds (`runs`, one dict(ttft, tpot) per round, kept for per-round ratios)
    and GB/s = (weight bytes + KV bytes read at `context`) / TPOT."""
    row = dict(name=name, threads=threads, batch=batch, prompt=prompt, ceiling_gb_s=ceiling, runs=runs,
               ttft_s=statistics.median(x["ttft"] for x in runs), tpot_s=statistics.median(x["tpot"] for x in runs))
    if name in ours:
        o = ours[name]
        elem = torch.finfo(o["kv_dtype"]).bits / 8
        step_bytes = o["weight_bytes"] + kv_bytes_per_step(o["model"], context, batch, elem)
    else:
        _, _, kv, weight_bytes = runners[name]
        van = next(o["model"] for n, o in ours.items() if n.startswith("vanilla "))
        step_bytes = weight_bytes + kv_bytes_per_step(van, context, 1, 4 if kv == "f32" else 2)
    row["gb_s"] = step_bytes / row["tpot_s"] / 1e9
    return row


def _one(name, ours, runners, ids, new_tokens):
    if name in ours:
        return run_ours(ours[name], ids, new_tokens)
    runner = runners[name][0]
    r = runner.generate(ids[0].tolist(), new_tokens)
    return dict(ttft=r["ttft_s"], tpot=statistics.median(r["step_s"]))


def peer_of(name: str) -> list[str]:
    """The llama.cpp rows a fusedkv row is compared with: same weight kind (16-bit -> f16, int8 -> q8_0,
    int4 -> q4_0 and q4_k_m) and same KV width; the f32 rows of any plan -> llama.cpp f32 (vanilla)."""
    w = name.split(" w=")[1].split()[0].split("@")[0]
    kv = "f32" if name.split(" kv=")[1].split()[0] == "f32" else "f16"
    types = {"f32": ["f32"], "bf16": ["f16"], "f16": ["f16"], "int8": ["q8_0"], "int4": ["q4_0", "q4_k_m"]}[w]
    return [f"llama.cpp w={ty} kv={kv}" for ty in types]


def round_ratio(row: dict, peer: dict, key: str) -> float:
    """Median over the rounds of row / peer, each round's pair measured back to back (a busy machine's
    slow phases then cancel); the ratio of the medians when the rounds do not pair up."""
    if len(row["runs"]) == len(peer["runs"]):
        return statistics.median(a[key] / b[key] for a, b in zip(row["runs"], peer["runs"]))
    return statistics.median(a[key] for a in row["runs"]) / statistics.median(b[key] for b in peer["runs"])


def format_rows(rows: list[dict], what: str = "prompt") -> str:
    """The table; ratio columns: per-round medians against each llama.cpp peer present (`peer_of`)."""
    lines = [f"| threads | batch | {what} | engine | TTFT ms | TPOT ms | GB/s (ceiling) | TTFT / llama.cpp | "
             "TPOT / llama.cpp |", "|---" * 9 + "|"]
    by = {(r["threads"], r["batch"], r["prompt"], r["name"]): r for r in rows}
    for r in rows:
        key = (r["threads"], r["batch"], r["prompt"])
        peers = [] if r["name"].startswith("llama.cpp") else [by[(*key, p)] for p in peer_of(r["name"])
                                                                if (*key, p) in by]
        ttft = ", ".join(f"{round_ratio(r, p, 'ttft'):.2f}" for p in peers) if what == "prompt" else ""
        tpot = ", ".join(f"{round_ratio(r, p, 'tpot'):.2f} ({p['name'].removeprefix('llama.cpp ')})" for p in peers)
        ttft_ms = f"{r['ttft_s'] * 1e3:.0f}" if what == "prompt" else "-"
        lines.append(f"| {r['threads']} | {r['batch']} | {r['prompt']} | {r['name']} | {ttft_ms} | "
                     f"{r['tpot_s'] * 1e3:.2f} | {r['gb_s']:.1f} ({r['ceiling_gb_s']:.0f}) | {ttft} | {tpot} |")
    return "\n".join(lines)


# ---- long context ------------------------------------------------------------------------------------
def fill_ours(row: dict, context: int, seed: torch.Tensor, new_tokens: int):
    """A static cache holding `context` tokens without a prefill of that length (quadratic: minutes at 32k):
    the seed prompt's K/V repeated along the sequence (a decode step's cost does not depend on the values, as
    `LlamaCppRunner.fill_cache` does for llama.cpp), and the token to decode next."""
    from fusedkv.engine.selection import set_decode_layout

    model = row["model"]
    set_decode_layout(model, 1)  # generate's "auto" layout at batch 1 (the native step's)
    cache = StaticKVCache(model.config, 1, context + new_tokens + 8, row["kv_dtype"])
    with torch.inference_mode():
        logits = model(seed, cache=cache, use_cache=True, logits_to_keep=1).logits
        m = seed.shape[1]
        for buf in (*cache.keys.values(), *cache.values.values()):
            buf[:, :, :context] = buf[:, :, :m].repeat(1, 1, -(-context // m), 1)[:, :, :context]
    cache._length = context
    return cache, logits[:, -1].argmax(-1, keepdim=True)


def decode_ours(model, cache, token: torch.Tensor, context: int, new_tokens: int) -> tuple[list[float], list[int]]:
    """`generate`'s decode loop from a cache of `context` tokens (the native step where it covers the model);
    the step times and the tokens. The cache is rolled back to `context` first."""
    from fusedkv.generation import sample_next

    cache._length = context
    times, tokens = [], []
    with torch.inference_mode(), select_runtime(model, cache=cache, batch=1, native_step=True) as runtime:
        step = runtime.native_step
        for pos in range(context, context + new_tokens):
            t0 = time.perf_counter()
            if step is not None:
                logits = step(token, None, pos)
                cache.advance(1)
            else:
                logits = model(token, cache=cache, use_cache=True).logits
            token = sample_next(logits[:, -1])
            times.append(time.perf_counter() - t0)
            tokens.append(int(token))
    return times, tokens


def long_run(args) -> list[dict]:
    """TPOT after `--long` tokens of cache (e.g. 8192,32768), fusedkv rows and llama.cpp rows interleaved as
    in `run` (a warm-up round, then --repeats rounds in rotated order); the caches are filled by repeating a
    --seed-len prompt (`fill_ours`, `LlamaCppRunner.fill_cache`), so a cell costs seconds, not a 32k prefill."""
    contexts = [int(c) for c in args.long.split(",")]
    max_len = max(contexts) + args.new_tokens + 8
    weights = [weight_spec(w) for w in args.weights.split(",")]
    kvs = ["float32" if k in ("float32", "f32") else "half" for k in args.kv.split(",")]
    ours, hf = our_rows(args.plans.split(","), weights, kvs, max_len)
    llama = setup_llama(args, hf)
    del hf
    seed = torch.randint(1, BenchShape().vocab_size, (1, args.seed_len), generator=torch.Generator().manual_seed(0))
    out = []
    for t in [int(x) for x in args.threads.split(",")]:
        torch.set_num_threads(t)
        runners = llama_runners(llama, args.llama_rows, max_len, t, n_batch=args.seed_len) if llama else {}
        ceiling = streaming_ceiling(max(r["weight_bytes"] for r in ours.values()))
        for c in contexts:
            state = {name: fill_ours(row, c, seed, args.new_tokens) for name, row in ours.items()}
            for name, (runner, *_) in runners.items():
                runner.fill_cache(c, seed[0].tolist())
                state[name] = int(runner.logits_last().argmax())
            names = list(state)
            samples: dict[str, list[dict]] = {n: [] for n in names}
            for r in range(args.repeats + 1):  # round 0 warms every engine up at this length
                shift = r % len(names)
                for name in names[shift:] + names[:shift]:
                    if name in ours:
                        times, _ = decode_ours(ours[name]["model"], *state[name], c, args.new_tokens)
                    else:
                        times = runners[name][0].decode_from(c, state[name], args.new_tokens)
                    if r:
                        samples[name].append(dict(ttft=float("nan"), tpot=statistics.median(times)))
                print(f"threads {t} context {c}: round {r}/{args.repeats}", file=sys.stderr)
            del state
            out += [make_row(name, runs, ours, runners, t, 1, c, c + args.new_tokens // 2, ceiling)
                    for name, runs in samples.items()]
        for runner, *_ in runners.values():
            runner.close()
    return out


# ---- kernels -----------------------------------------------------------------------------------------
def kernel_table(threads: int, rows_list: list[int], repeats: int) -> str:
    """One decode step's weight products (the bench shape: 8 layers, Q|K|V, O, gate|up, down, LM head)
    per weight format and input rows, through `ReducedLinear` (f32: the packed nn.Linear layout through
    MKL, and the same column-major weights through the native kernel, `fusedkv.kernels.cpu_gemv`, up to
    its MAX_ROWS). With several threads, also two ways to put a second core on an f32 one-row product
    through PyTorch: each weight split in two by output rows, the halves run by two Python threads (torch
    releases the GIL) or as one batched product (`torch.bmm`, two batch entries)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch.nn.functional as F
    from torch import nn

    from fusedkv.engine.precision import ReducedLinear

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    s = BenchShape()
    h, i = s.hidden_size, s.intermediate_size
    shapes = [(3 * h, h), (h, h), (2 * i, h), (h, i)] * s.num_hidden_layers + [(s.vocab_size, h)]
    linears = [nn.Linear(k, n, bias=False) for n, k in shapes]
    mods = {"f32": [_col(m) for m in linears]}
    for fmt in ("bfloat16", "float16", "int8", "int4"):
        mods[SHORT[fmt]] = [ReducedLinear.from_linears([m], fmt) for m in linears]
    nbytes = {k: sum(m.weight.numel() * m.weight.element_size() for m in ms) for k, ms in mods.items()}
    steps = {k: (lambda xs, ms=ms: [m(xs[m.in_features]) for m in ms]) for k, ms in mods.items()}
    if native.available():
        steps["f32 native"] = lambda xs, ms=mods["f32"]: [cpu_gemv.linear(xs[m.in_features], m.weight) for m in ms]
        nbytes["f32 native"] = nbytes["f32"]
    if threads > 1:
        pool = ThreadPoolExecutor(1)
        halves = [(w[: w.shape[0] // 2], w[w.shape[0] // 2:]) for w in (m.weight.detach() for m in linears)]
        halves = [(a.t().contiguous().t(), b.t().contiguous().t()) for a, b in halves]
        stacked = [torch.stack([a.t(), b.t()]).contiguous() for a, b in halves]  # [2, in, out/2]

        def two_threads(xs):
            for a, b in halves:
                x = xs[a.shape[1]]
                other = pool.submit(F.linear, x, b)
                torch.cat([F.linear(x, a), other.result()], -1)

        def bmm(xs):
            for w in stacked:
                x = xs[w.shape[1]]
                torch.bmm(x.expand(2, *x.shape), w).transpose(0, 1).reshape(x.shape[0], -1)

        steps["f32 2 Python threads"], steps["f32 bmm halves"] = two_threads, bmm
        nbytes["f32 2 Python threads"] = nbytes["f32 bmm halves"] = nbytes["f32"]
    ceiling = streaming_ceiling(nbytes["f32"])
    lines = [f"{threads} thread(s); streaming ceiling {ceiling:.1f} GB/s",
             "| rows | weights | ms per step | vs f32 | GB/s |", "|---|---|---|---|---|"]
    for rows in rows_list:
        xs = {k: torch.randn(rows, k) for k in (h, i)}
        times: dict[str, list[float]] = {k: [] for k in steps}
        with torch.inference_mode():
            for _ in range(repeats + 1):
                for k, step in steps.items():  # interleaved
                    if (rows > 1 and k.startswith("f32 ") and k != "f32 native"
                            or k == "f32 native" and rows > cpu_gemv.MAX_ROWS):
                        continue
                    t0 = time.perf_counter()
                    step(xs)
                    times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v[1:]) for k, v in times.items() if v}
        for k, t in med.items():
            lines.append(f"| {rows} | {k} | {t * 1e3:.2f} | {t / med['f32']:.2f} | {nbytes[k] / t / 1e9:.1f} |")
    return "\n".join(lines)


def _col(m):
    with torch.no_grad():
        m.weight.data = m.weight.data.t().contiguous().t()
    return m


# ---- per-step overhead -------------------------------------------------------------------------------
def _product_calls(model):
    """The weight products of one decode step, in the model's order, as (callable, input width)."""
    calls = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = attn.packed_qkv if attn.layer.stores and attn.packed_qkv is not None else None
        if qkv is not None:
            calls.append((qkv, attn.q_proj.in_features))
        else:
            calls += [(m, m.in_features) for m in
                      ([attn.q_proj, attn.k_proj, attn.v_proj] if attn.layer.stores else [attn.q_proj])]
        calls.append((attn.o_proj, attn.o_proj.in_features))
        if mlp.packed_gate_up is not None:
            calls.append((mlp.packed_gate_up, mlp.gate_proj.in_features))
        else:
            calls += [(mlp.gate_proj, mlp.gate_proj.in_features), (mlp.up_proj, mlp.up_proj.in_features)]
        calls.append((mlp.down_proj, mlp.down_proj.in_features))
    calls.append((model.lm_head, model.lm_head.in_features))
    return calls


def _dispatch_floor(plan: str, fmt: str, steps: int) -> float:
    """CPU ms of one decode step of the same plan and weight format at tiny widths (d=64, 8 heads of 8,
    vocab 64, 16 tokens of context): the same ops and Python as the bench model's step, next to no
    bytes, so what the step costs beyond its arithmetic and memory traffic."""
    from fusedkv.engine.selection import set_decode_layout
    from fusedkv.generation import sample_next

    tiny = BenchShape(hidden_size=64, intermediate_size=64, num_attention_heads=8, head_dim=8, vocab_size=64)
    model = build_models(tiny, [plan], 64, "cpu", torch.float32, include_hf=False)[plan]
    model = model if fmt == "float32" else reduce_precision(model, fmt, int4_rule=INT4_RULE)
    set_decode_layout(model, 1)
    select_runtime(model)  # the engine's attention implementations, as generate() runs them
    times = []
    with torch.inference_mode():
        cache = StaticKVCache(model.config, 1, 64, torch.float32)
        token = sample_next(model(torch.ones(1, 16, dtype=torch.long), cache=cache, use_cache=True,
                                  logits_to_keep=1).logits[:, -1])
        for i in range(4 * steps):
            if i % 32 == 0:
                cache._length = 16
            t0 = time.process_time()
            token = sample_next(model(token, cache=cache, use_cache=True).logits[:, -1])
            times.append(time.process_time() - t0)
    return statistics.median(times[4:]) * 1e3


def overhead_table(plans: list[str], weights: list[str], prompts: list[int], steps: int, kv: str) -> str:
    """Where one decode step's CPU time goes (`time.process_time`, this process only, so other jobs on a
    shared machine count only through memory bandwidth). The step is `generate`'s loop body: model
    forward on one token + greedy sampling, batch 1, weights in `generate`'s "auto" layout. Columns:
    products = the same weight modules run alone on one row, interleaved with the steps; rest = step -
    products (median of the pairs); dispatch floor = the same step at tiny widths (`_dispatch_floor`:
    Python, op dispatch and small-op arithmetic, no bytes); rest - floor = the work that scales with
    the context and widths (attention over the cache, mostly); ops = aten ops per step (profiler);
    native step = the same step as `generate` runs it by default, the layers in one native call
    (`fusedkv.engine.native_step`; "-" where it does not cover the model), interleaved with the others."""
    from torch.profiler import ProfilerActivity, profile

    from fusedkv.engine.native_step import NativeDecodeStep, unsupported
    from fusedkv.engine.selection import set_decode_layout
    from fusedkv.generation import sample_next

    torch.set_num_threads(1)
    kv_dtype = torch.float32 if kv in ("float32", "f32") else half_dtype()
    max_len = max(prompts) + steps + 8
    base = build_models(BenchShape(), plans, max_len, "cpu", torch.float32, include_hf=False)
    lines = [f"{torch.get_num_threads()} thread, batch 1, KV {kv_dtype}, {steps} steps per cell, medians; CPU time "
             f"(process_time). Load average at the start {open('/proc/loadavg').read().split()[0]}",
             "| plan | weights | prompt | step ms | products ms | rest ms | dispatch floor ms | rest - floor ms | "
             "ops per step | native step ms |", "|---" * 10 + "|"]
    for plan in plans:
        for fmt in weights:
            model = base[plan] if fmt == "float32" else reduce_precision(_copy(base[plan]), fmt, int4_rule=INT4_RULE)
            set_decode_layout(model, 1)
            select_runtime(model)
            products = _product_calls(model)
            floor = _dispatch_floor(plan, fmt, steps)
            for prompt in prompts:
                ids = torch.randint(1, BenchShape().vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
                xs = {w: torch.randn(1, 1, w) for _, w in products}
                with torch.inference_mode():
                    cache = StaticKVCache(model.config, 1, max_len, kv_dtype)
                    token = sample_next(model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1])
                    start = cache.get_seq_length()

                    def step(token, model=model, cache=cache):
                        return sample_next(model(token, cache=cache, use_cache=True).logits[:, -1])

                    native_step = (None if unsupported(model, cache.keys, cache.values, 1)
                                   else NativeDecodeStep(model, cache.keys, cache.values, 1))
                    step_t, prod_t, native_t = [], [], []
                    for i in range(steps):
                        if i % 8 == 0:  # stay near `prompt` tokens of context
                            cache._length = start
                        t0 = time.process_time()
                        token = step(token)
                        t1 = time.process_time()
                        for f, w in products:
                            f(xs[w])
                        t2 = time.process_time()
                        if native_step is not None:  # writes the column the next module step overwrites
                            sample_next(native_step(token, None, cache.get_seq_length())[:, -1])
                            native_t.append(time.process_time() - t2)
                        step_t.append(t1 - t0)
                        prod_t.append(t2 - t1)
                    cache._length = start
                    prof_steps = 4
                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        for _ in range(prof_steps):
                            token = step(token)
                ops = sum(e.count for e in prof.key_averages()) / prof_steps
                s, p = statistics.median(step_t[2:]) * 1e3, statistics.median(prod_t[2:]) * 1e3
                rest = statistics.median(a - b for a, b in zip(step_t[2:], prod_t[2:])) * 1e3
                fast = f"{statistics.median(native_t[2:]) * 1e3:.2f}" if native_t else "-"
                lines.append(f"| {plan} | {SHORT[fmt]} | {prompt} | {s:.2f} | {p:.2f} | {rest:.2f} | {floor:.2f} | "
                             f"{rest - floor:.2f} | {ops:.0f} | {fast} |")
                print(lines[-1], file=sys.stderr)
    return "\n".join(lines)


# ---- prefill profile ---------------------------------------------------------------------------------
PREFILL_GROUPS = (  # aten op name -> part of the prefill; first match wins, the rest is "other ops"
    ("GEMM", ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "mkldnn", "onednn",
              "fusedkv")),
    ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention")),
    ("norms + RoPE + SiLU", ("rms_norm", "aten::mul", "aten::add", "aten::cat", "aten::neg", "aten::silu",
                            "aten::pow", "aten::mean", "aten::rsqrt", "aten::sub")),
    ("copies", ("aten::copy_", "aten::contiguous", "aten::clone", "aten::to", "aten::_to_copy", "aten::index",
                "aten::slice_scatter", "aten::fill_", "aten::zero_", "aten::embedding")),
)


def prefill_profile(plans: list[str], weights: list[str], prompts: list[int], repeats: int,
                    kvs: list[torch.dtype]) -> str:
    """Where a prefill's time goes, 1 thread (`generate`'s prefill: select_runtime, then one forward over the
    prompt into a cache of each of `kvs`, asking for the last position's logits): torch.profiler's self CPU
    time per aten op, summed into GEMM (the projections and LM head), attention (SDPA), the elementwise ops
    around them and copies; "Python + dispatch" = the forward's wall time - the ops' self time. Median
    forward of `repeats`."""
    from torch.profiler import ProfilerActivity, profile

    from fusedkv.engine.selection import set_decode_layout

    torch.set_num_threads(1)
    max_len = max(prompts) + 8
    base = build_models(BenchShape(), plans, max_len, "cpu", torch.float32, include_hf=False)
    names = [g for g, _ in PREFILL_GROUPS]
    lines = [f"1 thread, batch 1, wall ms of one prefill (median of {repeats}) and its parts (profiler self CPU "
             f"time, ms); load average at the start {open('/proc/loadavg').read().split()[0]}",
             "| plan | weights | cache | prompt | prefill ms | " + " | ".join(names) + " | other ops | "
             "Python + dispatch | top ops |", "|---" * (len(names) + 8) + "|"]
    for plan in plans:
        for fmt in weights:
            model = base[plan] if fmt == "float32" else reduce_precision(_copy(base[plan]), fmt, int4_rule=INT4_RULE)
            set_decode_layout(model, 1)  # what generate's "auto" layout leaves at batch 1
            for kv, prompt in ((k, n) for k in kvs for n in prompts):
                ids = torch.randint(1, BenchShape().vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))

                def forward(model=model, ids=ids, prompt=prompt, kv=kv):
                    cache = StaticKVCache(model.config, 1, prompt + 8, kv)
                    with torch.inference_mode(), select_runtime(model, cache=cache, batch=1):
                        model(ids, cache=cache, use_cache=True, logits_to_keep=1)

                forward()
                walls = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    forward()
                    walls.append(time.perf_counter() - t0)
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    t0 = time.perf_counter()
                    forward()
                    profiled = time.perf_counter() - t0
                parts = dict.fromkeys([*names, "other ops"], 0.0)
                ops = {}
                for e in prof.key_averages():
                    ms = e.self_cpu_time_total / 1e3
                    group = next((g for g, keys in PREFILL_GROUPS if any(k in e.key for k in keys)), "other ops")
                    parts[group] += ms
                    ops[e.key] = ms
                top = ", ".join(f"{k} {v:.0f}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:3])
                python = profiled * 1e3 - sum(parts.values())
                lines.append(f"| {plan} | {SHORT[fmt]} | {SHORT[str(kv).removeprefix('torch.')]} | {prompt} | "
                             f"{statistics.median(walls) * 1e3:.0f} | "
                             + " | ".join(f"{v:.0f}" for v in parts.values()) + f" | {python:.0f} | {top} |")
                print(lines[-1], file=sys.stderr)
    return "\n".join(lines)


# ---- attention ---------------------------------------------------------------------------------------
def attention_table(threads: int, contexts: list[int], repeats: int) -> str:
    """The native one-token attention (`fusedkv.kernels.cpu_attention`) over the caches of the bench shape's
    layers (8 kv heads of 64, batch 1) in f32, bf16 and f16, at each context length: ms per layer (median),
    GB/s of K/V read, and the same bytes read by a plain sum (the read ceiling). Every layer's cache is read in
    turn, as in a decode step, so from a few thousand tokens on it comes from memory, not the caches."""
    from fusedkv.kernels import cpu_attention

    if not native.available():
        return "the native kernels are not built here (FUSEDKV_NATIVE_KERNELS, a C compiler)"
    torch.set_num_threads(threads)
    shape = BenchShape()
    h, d, layers = shape.num_attention_heads, shape.head_dim, shape.num_hidden_layers
    q = torch.randn(1, h, 1, d)
    lines = [f"{threads} thread(s), native one-token attention, {layers} layers of {h} heads of {d}, batch 1, "
             f"medians of {repeats}", "| context | cache | ms per layer | GB/s | read ceiling GB/s | ceiling / ours |",
             "|---|---|---|---|---|---|"]
    for context in contexts:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            kv = [[torch.randn(1, h, context, d).to(dtype) for _ in range(2)] for _ in range(layers)]
            words = [x.view(torch.float32) for pair in kv for x in pair]  # finite: 16-bit pairs are normal f32

            def call(kv=kv):
                for k, v in kv:
                    cpu_attention.one_token_attention(q, [k], [None], [v], [None], None, d**-0.5)

            def read(words=words):
                for w in words:
                    w.sum()

            times, ceiling = [], []
            for _ in range(repeats + 1):  # the first round warms up
                for fn, into in ((call, times), (read, ceiling)):
                    t0 = time.perf_counter()
                    fn()
                    into.append(time.perf_counter() - t0)
            ms = statistics.median(times[1:]) * 1e3 / layers
            nbytes = 2 * kv[0][0].numel() * kv[0][0].element_size()
            ceil_ms = statistics.median(ceiling[1:]) * 1e3 / layers
            lines.append(f"| {context} | {SHORT[str(dtype).removeprefix('torch.')]} | {ms:.3f} | "
                         f"{nbytes / ms / 1e6:.1f} | {nbytes / ceil_ms / 1e6:.1f} | {ceil_ms / ms:.2f} |")
            del kv, words
    return "\n".join(lines)


# ---- KIVI cache ---------------------------------------------------------------------------------------
def kivi_table(plans: list[str], threads: int, contexts: list[int], steps: int, repeats: int,
               models: dict | None = None, record: list | None = None) -> str:
    """TPOT of the native decode step over a KIVI-4 and a KIVI-2 cache (`fusedkv.kernels.cpu_kivi`: codes read
    in place) against the same step over a bf16 static cache, f32 weights, batch 1, at each context. The
    caches are filled with random post-RoPE K/V of the bench shape (no prefill: 32k tokens of it would take
    minutes); KIVI's through its own `update`, so they hold its codes, scales and 128-token residual. Each
    repeat times `steps` steps of every row, order rotated; ratios are per repeat, then medians. `models`:
    plan -> f32 model to use instead of the bench model (a real one, `--model`); `record`: each cell's medians,
    ratios and per-repeat seconds are appended to it (for a JSON)."""
    from fusedkv.engine.native_step import NativeDecodeStep
    from fusedkv.engine.selection import set_decode_layout
    from fusedkv.quant import KIVICache

    torch.set_num_threads(threads)
    room = steps * (repeats + 1) + 1
    models = models or build_models(BenchShape(), plans, max(contexts) + room, "cpu", torch.float32,
                                    include_hf=False)
    lines = [f"{threads} thread(s), native decode step, f32 weights, batch 1; TPOT ms (median of {repeats} "
             f"interleaved repeats of {steps} steps) and its ratio to the bf16 cache (median of per-repeat ratios)",
             "| plan | context | bf16 cache | KIVI-4 | KIVI-4 / bf16 | KIVI-2 | KIVI-2 / bf16 |",
             "|---|---|---|---|---|---|---|"]
    for plan in plans:
        model = set_decode_layout(models[plan], "packed")
        config = model.config
        for context in contexts:
            gen = torch.Generator().manual_seed(context)
            h_kv, d = config.num_key_value_heads, config.head_dim
            kv = {i: [torch.randn(1, h_kv, context, d, generator=gen) for _ in range(2)]
                  for i in config.plan.storage_layers}
            rows = {}
            static = StaticKVCache(config, 1, context + room, torch.bfloat16)
            for i, (k, v) in kv.items():
                static.keys[i][:, :, :context], static.values[i][:, :, :context] = k, v
            static.advance(context)
            rows["bf16"] = (NativeDecodeStep(model, static.keys, static.values, 1), static)
            for bits in (4, 2):
                cache = KIVICache(config, bits, max_len=context + room)
                step = NativeDecodeStep(model, {}, {}, 1, kivi=cache)  # reserves the cache's buffers
                for i, (k, v) in kv.items():
                    cache.layers[i].update(k, v)
                rows[f"KIVI-{bits}"] = (step, cache)
            del kv
            names = list(rows)
            for name in names:  # warm-up
                _step_tpot(*rows[name], steps)
            samples = {name: [] for name in names}
            for r in range(repeats):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    samples[name].append(_step_tpot(*rows[name], steps))
            med = {name: statistics.median(samples[name]) * 1e3 for name in names}
            ratio = {name: statistics.median(a / b for a, b in zip(samples[name], samples["bf16"])) for name in names}
            if record is not None:
                record.append(dict(plan=plan, context=context, threads=threads, tpot_ms=med, ratio_to_bf16=ratio,
                                   rounds_s=samples, load_average=os.getloadavg()))
            lines.append(f"| {plan} | {context} | {med['bf16']:.2f} | {med['KIVI-4']:.2f} | {ratio['KIVI-4']:.2f} | "
                         f"{med['KIVI-2']:.2f} | {ratio['KIVI-2']:.2f} |")
            print(lines[-1], file=sys.stderr)
    return "\n".join(lines)


def _step_tpot(step, cache, steps: int) -> float:
    """Median seconds of `steps` native decode steps (one token each) appended to `cache`."""
    token, times = torch.ones(1, 1, dtype=torch.long), []
    for _ in range(steps):
        t0 = time.perf_counter()
        step(token, None, cache.get_seq_length())
        cache.advance(1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- quality -----------------------------------------------------------------------------------------
def quality_table(checkpoint: str, windows: int, weights: list[str], kvs: list[torch.dtype],
                  llama: dict[str, Path] | None = None, llama_kv: dict[str, str] | None = None) -> str:
    """Per precision (`weights` x `kvs`): on held-out windows of the built-in corpus, (1) full-forward
    perplexity, (2) teacher-forced decode through the cache: max |logit - f32 logit|, top-1 agreement
    with the f32 full forward, and the perplexity of the decoded logits. `llama`: GGUF files of the same
    (vanilla) model, type -> path, each run by llama.cpp over every window in one batch (its prefill
    path, all logits; `fusedkv.speed.llamacpp.window_logits`) with KV type `llama_kv[type]`, compared the
    same way (its perplexity in the full-forward column and, against f32, in the "vs f32" column)."""
    import math

    import torch.nn.functional as F

    from fusedkv.data import prepare_dataset
    from fusedkv.data.loader import iter_eval_batches
    from fusedkv.model import FusedKVForCausalLM

    ref = FusedKVForCausalLM.from_pretrained(checkpoint).eval()
    ctx = ref.config.max_position_embeddings
    with tempfile.TemporaryDirectory() as tmp:
        shard = prepare_dataset("builtin", tmp, tokenizer=checkpoint).val
        batches = list(iter_eval_batches(shard, ctx, 1, max_batches=windows))
    configs = [(w, kv) for w in weights for kv in kvs]
    models = {w: reduced(ref, w) for w in weights}
    for model in models.values():
        select_runtime(model)  # decode through the engine's attention implementations, as generate() does
    lines = [f"{checkpoint} (plan {ref.config.kv_sharing}), {len(batches)} held-out windows of {ctx} tokens",
             "| weights | KV | full-forward ppl | decode ppl | decode ppl vs f32 | decode max abs logit diff vs f32 | "
             "top-1 agreement | mean KL vs f32 (1e-3 nats) |", "|---|---|---|---|---|---|---|---|"]
    with torch.inference_mode():
        refs = [ref(ids).logits for ids, _ in batches]
        ref_ppl = math.exp(sum(F.cross_entropy(r[0], y[0], reduction="sum").item() for r, (_, y) in zip(refs, batches))
                           / sum(y.numel() for _, y in batches))
        for w, kv in configs:
            model = models[w]
            nll_full = nll_dec = n = agree = kl = 0
            worst = 0.0
            for (ids, labels), ref_logits in zip(batches, refs):
                full = model(ids).logits
                nll_full += F.cross_entropy(full[0], labels[0], reduction="sum").item()
                cache = StaticKVCache(model.config, 1, ctx, kv)
                steps = [model(ids[:, t:t + 1], cache=cache, use_cache=True).logits[:, 0] for t in range(ids.shape[1])]
                dec = torch.cat(steps)
                nll_dec += F.cross_entropy(dec, labels[0], reduction="sum").item()
                worst = max(worst, (dec - ref_logits[0]).abs().max().item())
                agree += (dec.argmax(-1) == ref_logits[0].argmax(-1)).sum().item()
                kl += _kl_sum(ref_logits[0], dec)
                n += labels.numel()
            lines.append(f"| {short(w)} | {SHORT[str(kv).removeprefix('torch.')]} | {math.exp(nll_full / n):.3f} | "
                         f"{math.exp(nll_dec / n):.3f} | {100 * (math.exp(nll_dec / n) / ref_ppl - 1):+.2f}% | "
                         f"{worst:.4f} | {agree / n:.4f} | {1e3 * kl / n:.3f} |")
        from fusedkv.speed.llamacpp import window_logits

        for ty, path in (llama or {}).items():
            kv = (llama_kv or {}).get(ty, "f32")
            logits = window_logits(path, [ids[0].tolist() for ids, _ in batches], torch.get_num_threads(), kv)
            nll = n = agree = kl = 0
            worst = 0.0
            for out, (_, labels), ref_logits in zip(logits, batches, refs):
                out = torch.from_numpy(out).float()
                nll += F.cross_entropy(out, labels[0], reduction="sum").item()
                worst = max(worst, (out - ref_logits[0]).abs().max().item())
                agree += (out.argmax(-1) == ref_logits[0].argmax(-1)).sum().item()
                kl += _kl_sum(ref_logits[0], out)
                n += labels.numel()
            lines.append(f"| llama.cpp {ty} | {kv} | {math.exp(nll / n):.3f} | - | "
                         f"{100 * (math.exp(nll / n) / ref_ppl - 1):+.2f}% | {worst:.4f} | {agree / n:.4f} | "
                         f"{1e3 * kl / n:.3f} |")
    return "\n".join(lines)


def _kl_sum(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Sum over positions of KL(f32 model || this one), in nats: the whole next-token distribution's change (as
    llama.cpp's `perplexity --kl-divergence` reports), steadier than a perplexity difference over a few thousand
    tokens, whose sign a small change of the weights can flip."""
    p = torch.log_softmax(ref_logits.double(), -1)
    return (p.exp() * (p - torch.log_softmax(logits.double(), -1))).sum().item()


def quality_gguf(checkpoint: str, src: str | None, specs: str) -> tuple[dict[str, Path], dict[str, str]]:
    """GGUF files of a trained vanilla checkpoint (`export_vanilla_checkpoint`, then the converter and
    llama.cpp's quantizer) for each GGUF-type/KV spec, and the KV type of each."""
    from fusedkv.speed.llamacpp import convert_to_gguf, export_vanilla_checkpoint, find_converter

    work = Path(tempfile.mkdtemp(prefix="fusedkv-llamacpp-quality-"))
    root = find_converter(src, work, fetch=True)
    hf_dir = export_vanilla_checkpoint(checkpoint, work / "hf")
    kinds = dict(spec.split("/") for spec in specs.split(","))
    return {ty: convert_to_gguf(hf_dir, work / f"model-{ty}.gguf", ty, root) for ty in kinds}, kinds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plans", default="vanilla,fusedkv-lite")
    ap.add_argument("--weights", default="float32,half,int8", help="fusedkv weight formats (half = bf16 or f16 "
                    "by processor)")
    ap.add_argument("--kv", default="float32,half", help="fusedkv KV cache kinds: float32, half")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--prompt-lens", default="512,2048")
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--llamacpp-src", default=None, help="llama-cpp-python sdist (.tar.gz or unpacked) for the "
                    "converter; default $FUSEDKV_LLAMA_CPP_SRC; without it no llama.cpp rows")
    ap.add_argument("--llama-rows", default="f32/f32,f32/f16,f16/f16,q8_0/f16",
                    help="llama.cpp rows as GGUF-weights/KV (weights f32, f16, bf16, q8_0 from llama.cpp's converter, "
                    "q4_0, q4_k_m from its quantizer; KV f32, f16); with --quality, the GGUF files compared")
    ap.add_argument("--no-llama", action="store_true", help="no llama.cpp rows even where llama-cpp-python is "
                    "installed (with it and without --llamacpp-src, its sdist is fetched from the package registry)")
    ap.add_argument("--long", metavar="CONTEXTS", help="TPOT after this many tokens of cache instead (e.g. "
                    "8192,32768), caches filled without a prefill (see long_run); --plans, --weights, --kv, "
                    "--llama-rows, --threads, --new-tokens, --repeats as for the main table")
    ap.add_argument("--seed-len", type=int, default=256, help="--long: the prompt whose K/V fill the caches")
    ap.add_argument("--step", choices=("native", "modules", "both"), default="native",
                    help="how fusedkv rows decode: the layers in one native call where it covers the model "
                    "(generate's default), the modules one by one, or both as separate rows ('... modules')")
    ap.add_argument("--sliding-window", type=int, default=None, help="decode a sliding-window hybrid of the bench "
                    "model (window layers over ring caches); llama.cpp rows, if any, stay full attention")
    ap.add_argument("--architecture", default=None, help="JSON of FusedKVConfig fields for another architecture "
                    "of the bench model, e.g. '{\"num_experts\": 8, \"num_experts_per_tok\": 2, "
                    "\"moe_intermediate_size\": 384}' (fresh weights, no llama.cpp rows)")
    ap.add_argument("--kernels", action="store_true", help="print the kernel table instead")
    ap.add_argument("--kivi", action="store_true", help="print the KIVI-4 / KIVI-2 cache against the bf16 cache "
                    "instead: native step TPOT at each --prompt-lens tokens of cache (e.g. 2048,32768), --steps each")
    ap.add_argument("--attention", action="store_true", help="print the native attention table instead "
                    "(--threads, --prompt-lens as the context lengths, --repeats)")
    ap.add_argument("--rows", default="1,2,4,8,64,512", help="--kernels: input rows")
    ap.add_argument("--quality", metavar="CHECKPOINT", help="print the quality table for a trained checkpoint "
                    "(weight formats from --weights, e.g. float32,bfloat16,float16,int8,int4; KV kinds from --kv, "
                    "e.g. float32,bfloat16,float16)")
    ap.add_argument("--windows", type=int, default=16, help="--quality: held-out windows")
    ap.add_argument("--int4-rule", choices=precision.INT4_RULES, default=precision.INT4_RULE,
                    help="how int4 chooses its group scales (fusedkv.engine.precision.quantize_int4): the least "
                    "squared error (mse, the default) or llama.cpp's Q4_0 rule (q4_0), to compare them")
    ap.add_argument("--overhead", action="store_true", help="print where one decode step's CPU time goes (weight "
                    "products, the rest, its dispatch floor; 1 thread, batch 1; --plans, --weights, --prompt-lens, "
                    "--kv: one of float32, half)")
    ap.add_argument("--prefill", action="store_true", help="print where a prefill's time goes instead (1 thread; "
                    "--plans, --weights, --prompt-lens, --repeats)")
    ap.add_argument("--steps", type=int, default=64, help="--overhead: decode steps per cell")
    real = ap.add_argument_group("a real pretrained model instead of the bench model (cpu_decode_real.py)")
    real.add_argument("--model", metavar="CK|GGUF", help="a transformers checkpoint directory or a GGUF file: "
                      "fusedkv rows of its import (--plans, --weights), llama.cpp rows of the same float weights")
    real.add_argument("--gguf", metavar="FILE", help="--model: also run this GGUF file in llama.cpp (e.g. the "
                      "shipped Q4_1 file), a 4-bit peer")
    real.add_argument("--plan-checkpoints", metavar="PLAN=DIR,...", help="--model: the fusedkv checkpoint of a "
                      "plan (e.g. uptrained); other plans are converted untrained")
    real.add_argument("--text", metavar="FILE,...", help="--model: held-out texts for each row's perplexity")
    real.add_argument("--window", type=int, default=512, help="--model: tokens per quality window")
    real.add_argument("--json", metavar="FILE", help="--model: write the rows, runs and quality here")
    real.add_argument("--workdir", metavar="DIR", help="--model: keep converted models and GGUF files here "
                      "(reused by the next run)")
    args = ap.parse_args()
    if args.model:
        import cpu_decode_real

        if args.windows == ap.get_default("windows"):
            args.windows = 4
        cpu_decode_real.main(args)
        return
    global INT4_RULE
    INT4_RULE = args.int4_rule  # this script's choice, passed to every reduce_precision it makes
    if args.overhead:
        print(overhead_table(args.plans.split(","), [weight_format(w) for w in args.weights.split(",")],
                             [int(p) for p in args.prompt_lens.split(",")], args.steps, args.kv.split(",")[0]))
        return
    if args.prefill:
        print(prefill_profile(args.plans.split(","), [weight_format(w) for w in args.weights.split(",")],
                              [int(p) for p in args.prompt_lens.split(",")], args.repeats,
                              [kv_dtype_for(k) for k in args.kv.split(",")]))
        return
    if args.attention:
        for t in [int(x) for x in args.threads.split(",")]:
            print(attention_table(t, [int(c) for c in args.prompt_lens.split(",")], args.repeats))
        return
    if args.kivi:
        cells, start = [], os.getloadavg()
        for t in [int(x) for x in args.threads.split(",")]:
            print(kivi_table(args.plans.split(","), t, [int(c) for c in args.prompt_lens.split(",")], args.steps,
                             args.repeats, record=cells))
        if args.json:
            from fusedkv.utils import write_json_atomic

            write_json_atomic(args.json, dict(model="bench", processor=processor(), steps=args.steps,
                                              repeats=args.repeats, date=time.strftime("%Y-%m-%d %H:%M"),
                                              load_average=dict(start=start, end=os.getloadavg()), cells=cells))
        return
    if args.kernels:
        for t in [int(x) for x in args.threads.split(",")]:
            print(kernel_table(t, [int(r) for r in args.rows.split(",")], args.repeats))
        return
    if args.quality:
        from fusedkv.speed.llamacpp import available

        kvs = [kv_dtype_for(k) for k in args.kv.split(",")]
        why = None if args.no_llama else available()
        if why:
            print(why, file=sys.stderr)
        llama, llama_kv = ({}, {}) if args.no_llama or why else quality_gguf(
            args.quality, args.llamacpp_src, args.llama_rows)
        print(quality_table(args.quality, args.windows, [weight_spec(w) for w in args.weights.split(",")], kvs,
                            llama, llama_kv))
        return
    rows = long_run(args) if args.long else run(args)
    print(f"\nbench model {vars(_shape(args))}, {args.new_tokens} new tokens, medians of {args.repeats} interleaved "
          f"repeats (ratios: medians of per-round ratios); load average at the end "
          f"{open('/proc/loadavg').read().split()[0]}; native CPU product kernel: "
          f"{'on' if native.available() else 'off'} (FUSEDKV_NATIVE_KERNELS)"
          + ("; context = tokens in the cache, filled from a seed prompt (no TTFT)" if args.long else "") + "\n")
    print(format_rows(rows, "context" if args.long else "prompt"))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
