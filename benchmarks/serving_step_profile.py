"""Where a vLLM decode step's time goes, per plan, at two batch sizes: the profile behind the serving
throughput table (`serving_throughput.py`).

A half-size cache turns into throughput only if a step over 2N sequences costs less than two steps over N.
This script serves the same three checkpoints as `serving_throughput.py` (vanilla, fusedkv-lite, fusedkv)
with vLLM's offline engine and splits one decode step into: the linear layers (vLLM's oneDNN matmuls,
lm_head included), attention (vLLM's CPU op, or the project's native paged kernel for FusedKV's two-source
layers, cache writes included), the rest of the model's forward (norms, RoPE, activations, residuals),
logits, and the engine around the model (scheduler, input preparation, sampling, output processing).

It prints the processor and the attention path each layer took (vLLM's op and its ISA, or the native kernel with
its block layout and the loops this processor's build of it takes: `fusedkv.kernels.native.paged_loops`).

Times are CPU seconds of the engine's process (timers around the parts), so that a shared machine's
waiting for a core is not counted; a decode step is (a run of P + n tokens - a run of P + 1) / (n - 1),
the best of --repeats; the batch's prefill (the run of P + 1 tokens) is split the same way. One thread.

    OMP_NUM_THREADS=1 python benchmarks/serving_step_profile.py                  # 128-token prompts
    OMP_NUM_THREADS=1 python benchmarks/serving_step_profile.py --prompt-len 1024
    OMP_NUM_THREADS=1 python benchmarks/serving_step_profile.py --workload memory-bound   # the larger model
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARTS = ("linear", "attention", "other model", "logits", "engine")


class Timers:
    """CPU-seconds accumulators wrapped around callables (outermost call only, so nesting is not counted twice)."""

    def __init__(self):
        self.total: dict[str, float] = {}
        self.depth: dict[str, int] = {}

    def wrap(self, name: str, fn):
        self.total.setdefault(name, 0.0)
        self.depth.setdefault(name, 0)

        def timed(*a, **k):
            if self.depth[name]:
                return fn(*a, **k)
            self.depth[name] += 1
            t = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                self.total[name] += time.process_time() - t
                self.depth[name] -= 1
        return timed


def instrument(llm, timers: Timers) -> None:
    from vllm.model_executor.layers.linear import LinearBase

    from fusedkv.serving.paged import CrossLayerAttention

    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    model.forward = timers.wrap("model", model.forward)
    model.compute_logits = timers.wrap("logits", model.compute_logits)
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.forward = timers.wrap("linear", module.forward)
        impl = getattr(module, "impl", None)
        if impl is not None and hasattr(impl, "forward"):  # vLLM's impl or the project's CrossLayerAttention
            impl.forward = timers.wrap("attention", impl.forward)
            if not isinstance(impl, CrossLayerAttention):  # storage layers' cache writes
                impl.do_kv_cache_update = timers.wrap("attention", impl.do_kv_cache_update)
    # lm_head runs inside compute_logits: its matmul is counted as "linear" there, not twice.
    model.lm_head.quant_method.apply = timers.wrap("lm_head", model.lm_head.quant_method.apply)


def profile_engine(model_path: str, batches: list[int], prompt_len: int, new_tokens: int, repeats: int,
                   dtype: str, block_size: int) -> tuple[list[dict], list[str]]:
    """Rows per batch size, and how each decoder layer attends (`fusedkv.serving.offline.attention_paths`)."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from fusedkv.serving.offline import attention_paths

    cfg = json.loads((Path(model_path) / "config.json").read_text())
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * getattr(
        torch, dtype).itemsize  # K and V of every layer (an upper bound: the half plans store half)
    llm = LLM(model=model_path, dtype=dtype, block_size=block_size, kv_cache_memory_bytes=max(batches) * (
        prompt_len + new_tokens + 64) * per_token + (16 << 20), max_model_len=prompt_len + new_tokens,
              enforce_eager=True, seed=0, max_num_seqs=max(batches), enable_prefix_caching=False,
              skip_tokenizer_init=True)
    timers = Timers()
    instrument(llm, timers)
    paths = llm.apply_model(attention_paths)[0]
    g = torch.Generator().manual_seed(1)
    prompts = [TokensPrompt(prompt_token_ids=p)
               for p in torch.randint(2, cfg["vocab_size"], (max(batches), prompt_len), generator=g).tolist()]

    def run(batch: int, n: int) -> dict[str, float]:
        for k in timers.total:
            timers.total[k] = 0.0
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        t = time.process_time()
        llm.generate(prompts[:batch], params, use_tqdm=False)
        return {"step": time.process_time() - t, **timers.total}

    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False),
                 use_tqdm=False)
    def split(t: dict[str, float]) -> dict[str, float]:
        return {"linear": t["linear"] + t["lm_head"], "attention": t["attention"],
                "other model": t["model"] - t["linear"] - t["attention"], "logits": t["logits"] - t["lm_head"],
                "engine": t["step"] - t["model"] - t["logits"]}

    rows = []
    for batch in batches:
        best = prefill = None
        for _ in range(repeats):
            short, full = run(batch, 1), run(batch, new_tokens + 1)
            step = {k: (full[k] - short[k]) / new_tokens for k in full}
            if best is None or step["step"] < best["step"]:
                best = step
            if prefill is None or short["step"] < prefill["step"]:
                prefill = short
        rows.append({"batch": batch, "step_ms": 1e3 * best["step"],
                     "parts_ms": {k: 1e3 * v for k, v in split(best).items()},
                     # the run of P + 1 tokens: the batch's prefill and its first token
                     "prefill_ms": 1e3 * prefill["step"],
                     "prefill_parts_ms": {k: 1e3 * v for k, v in split(prefill).items()}})
    return rows, paths


def inner(args) -> None:
    from fusedkv.utils import processor

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its CPU time is ours
    out = {"processor": processor(), "profile": {}, "attention": {}}
    for path in args.models:
        name = Path(path).name
        out["profile"][name], out["attention"][name] = profile_engine(
            path, args.batches, args.prompt_len, args.new_tokens, args.repeats, args.dtype, args.block_size)
    Path(args.out).write_text(json.dumps(out))


def print_table(profile: dict, total: str, prefix: str, digits: int) -> None:
    """One markdown row per plan and batch: the total (`{prefix}ms` or `step_ms`), its parts, per sequence."""
    key = "step_ms" if total == "step" else f"{prefix}ms"
    print(f"| plan | batch | {total} | " + " | ".join(PARTS) + " | per sequence |\n|" + "---|" * (len(PARTS) + 4))
    for plan, rows in profile.items():
        for r in rows:
            parts = " | ".join(f"{r[f'{prefix}parts_ms'][k]:.{digits}f}" for k in PARTS)
            print(f"| {plan} | {r['batch']} | {r[key]:.{digits}f} | {parts} | {r[key] / r['batch']:.{digits + 1}f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batches", type=int, nargs="+", default=[8, 16])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workload", default="short", help="the model of this serving_throughput.py workload "
                   "(short and long: 4 layers, hidden 256; memory-bound: hidden 1024, GQA 16/4)")
    p.add_argument("--dtype", default=None, help="the model's and cache's dtype (default: the workload's)")
    p.add_argument("--block-size", type=int, default=32, help="vLLM's cache block size (tokens)")
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)  # the vLLM-side half
    p.add_argument("--models", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.inner:
        return inner(args)
    sys.path.insert(0, str(REPO / "benchmarks"))
    from serving_throughput import PLANS, WORKLOADS, write_checkpoints

    from fusedkv.serving.command import check_vllm_environment, find_vllm_python

    vllm_python = find_vllm_python(args.vllm_python)
    check_vllm_environment(vllm_python)
    if args.workload not in WORKLOADS:
        p.error(f"--workload: choose one of {', '.join(WORKLOADS)}")
    shape = {k: WORKLOADS[args.workload][k] for k in ("layers", "hidden", "kv_heads", "vocab")}
    ck_args = argparse.Namespace(**shape, prompt_len=args.prompt_len, new_tokens=args.new_tokens + 1)
    args.dtype = args.dtype or WORKLOADS[args.workload]["dtype"]
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        ckpts = write_checkpoints(Path(tmp) / "ckpts", ck_args)
        result = Path(tmp) / "profile.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING",
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        cmd = [vllm_python, __file__, "--inner", "--models", *(str(ckpts[p]) for p in PLANS), "--out", str(result),
               "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens), "--batches",
               *map(str, args.batches), "--repeats", str(args.repeats), "--dtype", args.dtype,
               "--block-size", str(args.block_size)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"vLLM run failed:\n{proc.stderr[-4000:]}")
        measured = json.loads(result.read_text())
    profile = measured["profile"]
    print(f"Processor: {measured['processor']}; each layer's attention path (a reconstruction layer on the native "
          "kernel: its block layout and the loops its scores / values take):")
    for plan, paths in measured["attention"].items():
        print(f"  {plan}: " + ", ".join(f"L{i} {p}" for i, p in enumerate(paths)))
    print()
    print(f"## One decode step, CPU ms ({args.prompt_len}-token prompts, steps {args.prompt_len + 1}-"
          f"{args.prompt_len + args.new_tokens}, {shape['layers']} layers, hidden {shape['hidden']}, "
          f"{shape['hidden'] // 64} query / {shape['kv_heads']} key-value heads of 64, vocabulary {shape['vocab']}, "
          f"{args.dtype}, eager, 1 thread; load "
          f"average {load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end)\n")
    print_table(profile, "step", "", 2)
    print(f"\n## The batch's prefill and first token, CPU ms (the run of {args.prompt_len} + 1 tokens, best of "
          f"{args.repeats})\n")
    print_table(profile, "prefill", "prefill_", 1)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "load_average": load, **measured}, indent=1) + "\n")


if __name__ == "__main__":
    main()
