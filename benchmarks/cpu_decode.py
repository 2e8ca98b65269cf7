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

Rows: `PLAN w=WEIGHTS kv=KV` for fusedkv (f32, bf16/f16, int8, int4 weights; f32 or 16-bit cache), and
`llama.cpp w=TYPE kv=TYPE` (f32, f16, q8_0 GGUF converted by llama.cpp's own converter; f32 or f16 KV)
when llama-cpp-python is installed and its source distribution is given (`fusedkv.bench.llamacpp`).
fusedkv rows decode as `fusedkv.generation.generate` does by default (the native step where it covers
the model); `--step both` adds each row again decoded module by module (`... modules`).
Every (threads, prompt, batch) cell runs all rows round-robin, the order rotated per repeat, and
reports medians; ratios are to llama.cpp with the same weight and KV kinds. llama.cpp runs one
sequence, so batch 4 compares fusedkv rows among themselves. GB/s = (weight bytes + KV bytes read)
per step / TPOT; the ceiling is `torch.sum` over as many bytes (as `benchmarks/decode_layout.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from fusedkv.bench.inference import HF, BenchShape, build_models
from fusedkv.cache import StaticKVCache
from fusedkv.engine import select_runtime
from fusedkv.engine.precision import half_dtype, kv_dtype_for, reduce_precision, weight_format, weight_nbytes
from fusedkv.generation import generate
from fusedkv.kernels import cpu_gemv, native

SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int8": "int8", "int4": "int4"}


# ---- fusedkv rows ------------------------------------------------------------------------------------
def our_rows(plans: list[str], weights: list[str], kvs: list[str], max_len: int,
             shape: BenchShape | None = None) -> dict[str, dict]:
    """label -> dict(model, kv_dtype, weight_bytes): one model per (plan, weight format)."""
    base = build_models(shape or BenchShape(), plans, max_len, "cpu", torch.float32, include_hf=True)
    rows = {}
    for plan in plans:
        for fmt in weights:
            model = base[plan] if fmt == "float32" else reduce_precision(_copy(base[plan]), fmt)
            # An f32 cache is compared for f32 weights only (llama.cpp's 16-bit weights run an f16 cache).
            for kv in kvs if fmt == "float32" else [k for k in kvs if k != "float32"] or kvs:
                kv_dtype = torch.float32 if kv == "float32" else half_dtype()
                label = f"{plan} w={SHORT[fmt]} kv={SHORT[str(kv_dtype).removeprefix('torch.')]}"
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
LLAMA_BYTES_PER_WEIGHT = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32}  # q8_0: 32 int8 + one f16 scale


def llama_models(hf_model, src: str, workdir: Path, types: list[str]) -> dict[str, Path]:
    from fusedkv.bench.llamacpp import convert_to_gguf, export_hf_checkpoint, find_converter

    root = find_converter(src, workdir)
    hf_dir = export_hf_checkpoint(hf_model, workdir / "hf")
    return {t: convert_to_gguf(hf_dir, workdir / f"bench-{t}.gguf", t, root) for t in types}


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
    weights = [weight_format(w) for w in args.weights.split(",")]
    kvs = ["float32" if k in ("float32", "f32") else "half" for k in args.kv.split(",")]
    ours, hf = our_rows(args.plans.split(","), weights, kvs, max_len, _shape(args))
    if args.step != "native":  # the module-by-module loop, as rows of their own ("both") or instead
        modules = {f"{name} modules": dict(row, native_step=False) for name, row in ours.items()}
        ours = {**(ours if args.step == "both" else {}), **modules}
    llama: dict[str, Path] = {}
    workdir = Path(tempfile.mkdtemp(prefix="fusedkv-llamacpp-"))
    if args.llamacpp_src and hf is not None:
        from fusedkv.bench.llamacpp import available

        why = available()
        if why:
            print(why, file=sys.stderr)
        else:
            types = list(dict.fromkeys(spec.split("/")[0] for spec in args.llama_rows.split(",")))
            llama = llama_models(hf, args.llamacpp_src, workdir, types)
    del hf
    vocab = BenchShape().vocab_size
    out = []
    gen = torch.Generator().manual_seed(0)
    for t in threads:
        torch.set_num_threads(t)
        runners = {}
        if llama:
            from fusedkv.bench.llamacpp import LlamaCppRunner

            for spec in args.llama_rows.split(","):
                ty, kv = spec.split("/")
                runners[f"llama.cpp w={ty} kv={kv}"] = (LlamaCppRunner(llama[ty], max_len, t, kv), ty, kv)
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
                    row = dict(name=name, threads=t, batch=b, prompt=s, ceiling_gb_s=ceiling,
                               ttft_s=statistics.median(x["ttft"] for x in runs),
                               tpot_s=statistics.median(x["tpot"] for x in runs))
                    context = s + args.new_tokens // 2
                    if name in ours:
                        o = ours[name]
                        elem = torch.finfo(o["kv_dtype"]).bits / 8
                        step_bytes = o["weight_bytes"] + kv_bytes_per_step(o["model"], context, b, elem)
                    else:
                        _, ty, kv = runners[name]
                        van = next(o["model"] for n, o in ours.items() if n.startswith("vanilla "))
                        params = weight_nbytes(van) / 4  # same projections and head as our vanilla f32
                        step_bytes = params * LLAMA_BYTES_PER_WEIGHT[ty] + kv_bytes_per_step(
                            van, context, 1, 4 if kv == "f32" else 2)
                    row["gb_s"] = step_bytes / row["tpot_s"] / 1e9
                    out.append(row)
        for runner, _, _ in runners.values():
            runner.close()
    return out


def _shape(args) -> BenchShape:
    """The bench model, as a sliding-window hybrid with --sliding-window (three window layers, then a full one),
    with --architecture's config fields (MoE, MLA) on every layer."""
    return BenchShape(sliding_window=args.sliding_window, architecture=json.loads(args.architecture or "{}"))


def _one(name, ours, runners, ids, new_tokens):
    if name in ours:
        return run_ours(ours[name], ids, new_tokens)
    runner = runners[name][0]
    r = runner.generate(ids[0].tolist(), new_tokens)
    return dict(ttft=r["ttft_s"], tpot=statistics.median(r["step_s"]))


def peer_of(name: str) -> list[str]:
    """The llama.cpp rows a fusedkv row is compared with: same weight kind (16-bit -> f16, int8 ->
    q8_0, int4 -> q4_0: not among the rows the converter writes yet, so int4 has no ratio) and same KV width."""
    w = name.split(" w=")[1].split()[0]
    kv = name.split(" kv=")[1].split()[0]
    ty = {"f32": "f32", "bf16": "f16", "f16": "f16", "int8": "q8_0", "int4": "q4_0"}[w]
    return [f"llama.cpp w={ty} kv={'f32' if kv == 'f32' else 'f16'}"]


def format_rows(rows: list[dict]) -> str:
    lines = ["| threads | batch | prompt | engine | TTFT ms | TPOT ms | GB/s (ceiling) | TTFT / llama.cpp | "
             "TPOT / llama.cpp |", "|---" * 9 + "|"]
    by = {(r["threads"], r["batch"], r["prompt"], r["name"]): r for r in rows}
    for r in rows:
        peer = next((by[(r["threads"], r["batch"], r["prompt"], p)] for p in peer_of(r["name"])
                     if (r["threads"], r["batch"], r["prompt"], p) in by), None) \
            if not r["name"].startswith("llama.cpp") else None
        ttft_ratio = f"{r['ttft_s'] / peer['ttft_s']:.2f}" if peer else ""
        tpot_ratio = f"{r['tpot_s'] / peer['tpot_s']:.2f} ({peer['name'].removeprefix('llama.cpp ')})" if peer else ""
        lines.append(f"| {r['threads']} | {r['batch']} | {r['prompt']} | {r['name']} | {r['ttft_s'] * 1e3:.0f} | "
                     f"{r['tpot_s'] * 1e3:.2f} | {r['gb_s']:.1f} ({r['ceiling_gb_s']:.0f}) | {ttft_ratio} | "
                     f"{tpot_ratio} |")
    return "\n".join(lines)


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
    from fusedkv.engine.packing import set_decode_layout
    from fusedkv.generation import sample_next

    tiny = BenchShape(hidden_size=64, intermediate_size=64, num_attention_heads=8, head_dim=8, vocab_size=64)
    model = build_models(tiny, [plan], 64, "cpu", torch.float32, include_hf=False)[plan]
    model = model if fmt == "float32" else reduce_precision(model, fmt)
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
    from fusedkv.engine.packing import set_decode_layout
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
            model = base[plan] if fmt == "float32" else reduce_precision(_copy(base[plan]), fmt)
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


# ---- attention ---------------------------------------------------------------------------------------
def attention_table(threads: int, contexts: list[int], repeats: int) -> str:
    """The native one-token attention (`fusedkv.kernels.cpu_attention`) over one layer's cache of the bench
    shape (8 kv heads of 64, batch 1) in f32, bf16 and f16, at each context length: ms per call (median)
    and GB/s of K/V read. From 8k tokens on the cache (16-67 MB) no longer fits the caches, as in a
    decode step, which reads every layer's cache in turn."""
    from fusedkv.kernels import cpu_attention

    torch.set_num_threads(threads)
    h, d = BenchShape().num_attention_heads, BenchShape().head_dim
    q = torch.randn(1, h, 1, d)
    lines = [f"{threads} thread(s), native one-token attention, {h} heads of {d}, batch 1, medians of {repeats}",
             "| context | cache | ms per call | GB/s |", "|---|---|---|---|"]
    for context in contexts:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            k, v = (torch.randn(1, h, context, d).to(dtype) for _ in range(2))

            def call(k=k, v=v):
                return cpu_attention.decode_attention(q, [k], [None], [v], [None], None, d**-0.5)

            if call() is None:
                return "the native kernels are not built here (FUSEDKV_NATIVE_KERNELS, a C compiler)"
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            ms = statistics.median(times) * 1e3
            nbytes = 2 * k.numel() * k.element_size()
            lines.append(f"| {context} | {SHORT[str(dtype).removeprefix('torch.')]} | {ms:.3f} | "
                         f"{nbytes / ms / 1e6:.1f} |")
    return "\n".join(lines)


# ---- quality -----------------------------------------------------------------------------------------
def quality_table(checkpoint: str, windows: int, weights: list[str], kvs: list[torch.dtype]) -> str:
    """Per precision (`weights` x `kvs`): on held-out windows of the built-in corpus, (1) full-forward
    perplexity, (2) teacher-forced decode through the cache: max |logit - f32 logit|, top-1 agreement
    with the f32 full forward, and the perplexity of the decoded logits."""
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
    models = {w: ref if w == "float32" else reduce_precision(_copy(ref), w) for w in weights}
    for model in models.values():
        select_runtime(model)  # decode through the engine's attention implementations, as generate() does
    lines = [f"{checkpoint} (plan {ref.config.kv_sharing}), {len(batches)} held-out windows of {ctx} tokens",
             "| weights | KV | full-forward ppl | decode ppl | decode ppl vs f32 | decode max abs logit diff vs f32 | "
             "top-1 agreement |", "|---|---|---|---|---|---|---|"]
    with torch.inference_mode():
        refs = [ref(ids).logits for ids, _ in batches]
        ref_ppl = math.exp(sum(F.cross_entropy(r[0], y[0], reduction="sum").item() for r, (_, y) in zip(refs, batches))
                           / sum(y.numel() for _, y in batches))
        for w, kv in configs:
            model = models[w]
            nll_full = nll_dec = n = agree = 0
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
                n += labels.numel()
            lines.append(f"| {SHORT[w]} | {SHORT[str(kv).removeprefix('torch.')]} | {math.exp(nll_full / n):.3f} | "
                         f"{math.exp(nll_dec / n):.3f} | {100 * (math.exp(nll_dec / n) / ref_ppl - 1):+.2f}% | "
                         f"{worst:.4f} | {agree / n:.4f} |")
    return "\n".join(lines)


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
                    help="llama.cpp rows as GGUF-weights/KV (weights f32, f16, bf16, q8_0; KV f32, f16)")
    ap.add_argument("--step", choices=("native", "modules", "both"), default="native",
                    help="how fusedkv rows decode: the layers in one native call where it covers the model "
                    "(generate's default), the modules one by one, or both as separate rows ('... modules')")
    ap.add_argument("--sliding-window", type=int, default=None, help="decode a sliding-window hybrid of the bench "
                    "model (window layers over ring caches); llama.cpp rows, if any, stay full attention")
    ap.add_argument("--architecture", default=None, help="JSON of FusedKVConfig fields for another architecture "
                    "of the bench model, e.g. '{\"num_experts\": 8, \"num_experts_per_tok\": 2, "
                    "\"moe_intermediate_size\": 384}' (fresh weights, no llama.cpp rows)")
    ap.add_argument("--kernels", action="store_true", help="print the kernel table instead")
    ap.add_argument("--attention", action="store_true", help="print the native attention table instead "
                    "(--threads, --prompt-lens as the context lengths, --repeats)")
    ap.add_argument("--rows", default="1,2,4,8,64,512", help="--kernels: input rows")
    ap.add_argument("--quality", metavar="CHECKPOINT", help="print the quality table for a trained checkpoint "
                    "(weight formats from --weights, e.g. float32,bfloat16,float16,int8,int4; KV kinds from --kv, "
                    "e.g. float32,bfloat16,float16)")
    ap.add_argument("--windows", type=int, default=16, help="--quality: held-out windows")
    ap.add_argument("--overhead", action="store_true", help="print where one decode step's CPU time goes (weight "
                    "products, the rest, its dispatch floor; 1 thread, batch 1; --plans, --weights, --prompt-lens, "
                    "--kv: one of float32, half)")
    ap.add_argument("--steps", type=int, default=64, help="--overhead: decode steps per cell")
    args = ap.parse_args()
    if args.overhead:
        print(overhead_table(args.plans.split(","), [weight_format(w) for w in args.weights.split(",")],
                             [int(p) for p in args.prompt_lens.split(",")], args.steps, args.kv.split(",")[0]))
        return
    if args.attention:
        for t in [int(x) for x in args.threads.split(",")]:
            print(attention_table(t, [int(c) for c in args.prompt_lens.split(",")], args.repeats))
        return
    if args.kernels:
        for t in [int(x) for x in args.threads.split(",")]:
            print(kernel_table(t, [int(r) for r in args.rows.split(",")], args.repeats))
        return
    if args.quality:
        kvs = [kv_dtype_for(k) for k in args.kv.split(",")]
        print(quality_table(args.quality, args.windows, [weight_format(w) for w in args.weights.split(",")], kvs))
        return
    import os

    args.llamacpp_src = args.llamacpp_src or os.environ.get("FUSEDKV_LLAMA_CPP_SRC")
    rows = run(args)
    print(f"\nbench model {vars(_shape(args))}, {args.new_tokens} new tokens, medians of {args.repeats} interleaved "
          f"repeats; load average at the end {open('/proc/loadavg').read().split()[0]}; native CPU product "
          f"kernel: {'on' if native.available() else 'off'} (FUSEDKV_NATIVE_KERNELS)\n")
    print(format_rows(rows))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
