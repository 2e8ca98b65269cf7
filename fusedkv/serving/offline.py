"""Run FusedKV checkpoints through vLLM's offline engine and print what it did, as JSON.

Runs in the vLLM environment (the tests and the benchmark call it there, since the two environments
differ):

    .venv-vllm/bin/python -m fusedkv.serving.offline --models CKPT [CKPT ...] --prompts prompts.json \
        --max-new-tokens 24 --prompt-logprobs --out result.json

`prompts.json` is a list of token-id lists (token ids, not text, so that both sides see the same
inputs). For every checkpoint: greedy tokens, the log-probability of each prompt token after the
first, vLLM's cache capacity (blocks, tokens, max concurrency), the class of each layer's MLP (which
MoE path ran) and, with --timed, the wall time.
The checkpoints run one after another in this process (in-process engine, eager mode), so a
comparison of many plans pays vLLM's start-up once per checkpoint, not once per process.

For benchmarks, `--rounds N` keeps one engine per checkpoint alive, warms each up (a short generate
of the same shape), then times N rounds; round r runs the engines in an order rotated by r, so drift of
a busy machine falls on every engine alike. `elapsed_s` is then the list of per-round seconds.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

from ..utils import processor


def engine_kwargs(args, fast_prefill: bool | None = None) -> dict:
    return dict(dtype=args.dtype, block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory,
                max_model_len=args.max_model_len, enforce_eager=not args.compile, seed=0,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=False, skip_tokenizer_init=True,
                kv_sharing_fast_prefill=args.fast_prefill if fast_prefill is None else fast_prefill)


def sampling(args, max_tokens: int | None = None):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens or args.max_new_tokens, ignore_eos=True,
                          prompt_logprobs=0 if args.prompt_logprobs else None, detokenize=False)


def timed_generate(llm, prompts: list[list[int]], params) -> tuple[list, float, float]:
    """Outputs, wall seconds, CPU seconds of this process (the engine runs in it)."""
    from vllm.inputs import TokensPrompt

    start, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return outputs, time.perf_counter() - start, time.process_time() - cpu


def run_one(model: str, prompts: list[list[int]], args) -> dict:
    from vllm import LLM

    llm = LLM(model=model, **engine_kwargs(args))
    outputs, elapsed, _ = timed_generate(llm, prompts, sampling(args))
    result = describe(llm, model, prompts, outputs, args)
    result["elapsed_s"] = elapsed
    del llm
    gc.collect()
    return result


class ScheduleLog:
    """Counts what vLLM's scheduler does in an in-process engine: steps, preemptions (a request pushed back
    to recompute when the cache is full), and the requests of each decode-only step."""

    def __init__(self, llm):
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler  # in-process engine (see main)
        self.reset()
        schedule, preempt = scheduler.schedule, scheduler._preempt_request

        def logged_schedule(*a, **k):
            out = schedule(*a, **k)
            tokens = out.num_scheduled_tokens
            if tokens:
                self.steps += 1
                if out.total_num_scheduled_tokens == len(tokens):  # every request one token: a decode step
                    self.decode_batches.append(len(tokens))
            return out

        def logged_preempt(*a, **k):
            self.preemptions += 1
            return preempt(*a, **k)

        scheduler.schedule, scheduler._preempt_request = logged_schedule, logged_preempt

    def reset(self) -> None:
        self.steps, self.preemptions, self.decode_batches = 0, 0, []

    def summary(self) -> dict:
        n = len(self.decode_batches)
        return {"steps": self.steps, "preemptions": self.preemptions, "decode_steps": n,
                "mean_decode_batch": sum(self.decode_batches) / n if n else 0.0,
                "max_decode_batch": max(self.decode_batches, default=0)}


def run_rounds(models: list[str], prompts: list[list[int]], args) -> list[dict]:
    """One engine per model (then one per `--fast-prefill-models` entry, with fast prefill), each warmed up,
    then `args.rounds` timed rounds in rotated order."""
    from vllm import LLM

    specs = [(m, None) for m in models] + [(m, True) for m in args.fast_prefill_models]
    engines = [LLM(model=m, **engine_kwargs(args, fast)) for m, fast in specs]
    logs = [ScheduleLog(llm) for llm in engines]
    for llm in engines:  # warm-up: the same batch shape, a few tokens
        timed_generate(llm, prompts, sampling(args, max_tokens=min(8, args.max_new_tokens)))
    elapsed: list[list[float]] = [[] for _ in specs]
    cpu: list[list[float]] = [[] for _ in specs]
    outputs: list = [None] * len(specs)
    schedules: list = [None] * len(specs)
    for r in range(args.rounds):
        for i in (r % len(specs) + j for j in range(len(specs))):
            i %= len(specs)
            logs[i].reset()
            outputs[i], seconds, cpu_seconds = timed_generate(engines[i], prompts, sampling(args))
            elapsed[i].append(seconds)
            cpu[i].append(cpu_seconds)
            schedules[i] = logs[i].summary()
    results = []
    for (model, fast), llm, out, times, cpu_times, sched in zip(specs, engines, outputs, elapsed, cpu, schedules):
        fast = args.fast_prefill if fast is None else fast
        results.append({**describe(llm, model, prompts, out, args), "elapsed_s": times, "cpu_s": cpu_times,
                        "schedule": sched, "fast_prefill": fast})
    return results


def describe(llm, model: str, prompts: list[list[int]], outputs, args) -> dict:
    cache = llm.llm_engine.vllm_config.cache_config
    hf_config = llm.llm_engine.vllm_config.model_config.hf_config
    rows = []
    for prompt, out in zip(prompts, outputs):
        row = {"tokens": list(out.outputs[0].token_ids)}
        if args.prompt_logprobs:
            # Entry i (i >= 1) maps token ids to logprobs; the prompt's own token is always among them.
            row["prompt_logprobs"] = [entry[tok].logprob for tok, entry in zip(prompt[1:], out.prompt_logprobs[1:])]
        rows.append(row)
    result = {"model": model, "rows": rows, "kv_heads": hf_config.num_key_value_heads,
              "storage_layers": list(hf_config.plan.storage_layers),
              "num_blocks": cache.num_gpu_blocks, "block_size": cache.block_size,
              "kv_cache_tokens": cache.kv_cache_size_tokens, "max_concurrency": cache.kv_cache_max_concurrency,
              "generated_tokens": sum(len(r["tokens"]) for r in rows),
              "mlp": llm.apply_model(mlp_kinds)[0], "attention": llm.apply_model(attention_paths)[0],
              "processor": processor()}
    return result


def attention_paths(model) -> list[str]:
    """How every decoder layer attends: a storage layer vLLM's op (its ISA), a plain-reuse layer vLLM's KV sharing,
    a reconstruction layer its selected path (`paged.select_paths`) and the native kernel's block layout."""
    from .paged import CrossLayerAttention

    paths = []
    for layer in model.model.layers:
        attn = getattr(layer.self_attn, "attn", None)
        impl = getattr(attn, "impl", None)
        isa = getattr(attn, "isa", "?")
        if isinstance(impl, CrossLayerAttention):
            layout = "" if impl.kernel_layout is None else f" layout {impl.kernel_layout}"
            paths.append(f"{impl.path}{layout}{native_loops(impl, attn, model)} ({impl.kv_cache_dtype} cache)")
        elif attn is None:
            paths.append(type(layer.self_attn).__name__)
        elif getattr(layer.self_attn, "layer", None) is not None and not layer.self_attn.layer.stores:
            paths.append(f"vllm shared ({isa})")
        else:
            paths.append(f"vllm ({isa})")
    return paths


def native_loops(impl, attn, model) -> str:
    """", loops scores/values" for a layer on the native kernel: which of its loops this processor's build takes
    (`fusedkv.kernels.native.paged_loops`), else ""."""
    from ..kernels import native
    from .paged_blocks import cache_element_dtype

    cache = attn.kv_cache[0] if isinstance(attn.kv_cache, (list, tuple)) else attn.kv_cache
    if impl.path != "native" or impl.kernel_layout is None or cache.dim() != 4:
        return ""
    dtype = cache_element_dtype(impl.kv_cache_dtype, next(model.parameters()).dtype)
    scores, values = native.paged_loops(dtype, impl.kernel_layout, impl.head_size, cache.shape[2])
    return f", loops {scores}/{values}"


def mlp_kinds(model) -> list[str]:
    """The class of every decoder layer's MLP (which MoE path the plugin chose: `vllm_moe`)."""
    return [type(layer.mlp).__name__ for layer in model.model.layers]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", required=True)
    p.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--prompt-logprobs", action="store_true")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--kv-cache-memory", type=int, default=64 << 20, help="KV-cache bytes (default 64 MiB)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per engine step; below the prompt length it splits prefills into chunks")
    p.add_argument("--fast-prefill", action="store_true",
                   help="vLLM's kv_sharing_fast_prefill: layers without a cache skip all but the sampled positions")
    p.add_argument("--fast-prefill-models", nargs="*", default=[],
                   help="with --rounds: also run these checkpoints with kv_sharing_fast_prefill, as extra engines")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (default: eager)")
    p.add_argument("--rounds", type=int, default=0,
                   help="benchmark: keep an engine per model, warm each up, time this many rotated rounds")
    p.add_argument("--out", default="-")
    args = p.parse_args(argv)
    # One process, engine in it: cheaper start-up per checkpoint, and results come back directly.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with open(args.prompts) as f:
        prompts = json.load(f)
    if args.fast_prefill_models and not args.rounds:
        p.error("--fast-prefill-models needs --rounds")
    if args.rounds:
        results = run_rounds(args.models, prompts, args)
    else:
        results = [run_one(m, prompts, args) for m in args.models]
    text = json.dumps(results)
    if args.out == "-":
        sys.stdout.write(text + "\n")
    else:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
