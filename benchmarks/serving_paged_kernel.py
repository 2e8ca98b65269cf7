"""One reconstruction layer's decode attention over vLLM's paged CPU cache, per plan, on this processor: what
`serving_step_profile.py`'s "attention" column is made of, without an engine around it.

Per decode step of a batch: vanilla's and Lite's layers call vLLM's CPU op (one key cache and one value cache: a
Lite layer reads layer n's keys and layer 1's values, the same op on other caches); a FusedKV layer calls the
project's native paged kernel (`cpu_paged_attention.c`) over two weighted key and two weighted value sources,
read in place through the block table (the same kernel over one source each is printed beside it). The cache is
the memory-bound workload's shape (`serving_throughput.py --workload memory-bound`: 16 query / 4 key-value heads of
64, blocks of 32) with random contents and a shuffled block table; the layout does not change the work timed.
Prints the processor, vLLM's ISA and the native kernel's loops (`fusedkv.kernels.native.paged_loops`), then CPU
milliseconds per call (process time, so that a shared machine's waiting is not counted), the calls interleaved in
rotated order per round, medians and per-round ratios to vLLM's op. One thread. Runs in vLLM's environment:

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv-vllm/bin/python benchmarks/serving_paged_kernel.py --dtype bfloat16
    OMP_NUM_THREADS=1 PYTHONPATH=. .venv-vllm/bin/python benchmarks/serving_paged_kernel.py --dtype float32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=384, help="keys per sequence (the workload's mid-decode length)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--calls", type=int, default=20, help="calls per timing")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args()

    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from fusedkv.kernels import native
    from fusedkv.serving.paged_blocks import split_cpu_kv_cache
    from fusedkv.serving.paged_native import native_paged_attention, query_rows
    from fusedkv.utils import processor

    torch.set_num_threads(1)
    dtype, B, L, H, H_kv, D, bs = (getattr(torch, args.dtype), args.batch, args.context, args.heads, args.kv_heads,
                                   args.head_dim, args.block_size)
    g = torch.Generator().manual_seed(0)
    per_seq = -(-L // bs)
    num_blocks = B * per_seq + 1
    caches = [split_cpu_kv_cache(torch.randn(num_blocks, H_kv, bs, 2 * D, generator=g).to(dtype)) for _ in range(2)]
    table = torch.randperm(num_blocks, generator=g)[:B * per_seq].view(B, per_seq).to(torch.int32).contiguous()
    seq_lens = torch.full((B,), L, dtype=torch.int32)
    qsl = torch.arange(B + 1, dtype=torch.int32)
    q = torch.randn(B, H, D, generator=g).to(dtype)
    weights = [torch.rand(H_kv, D, generator=g) + 0.5 for _ in range(2)]
    scale = D**-0.5
    isa = _get_attn_isa(dtype, bs, D, "auto")
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=B, num_heads=H, num_kv_heads=H_kv, head_dim=D, seq_lens=seq_lens, dtype=dtype, query_start_loc=qsl,
        causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False, kv_cache_dtype="auto")
    rows = query_rows(qsl, seq_lens, B)
    out = torch.empty_like(q)
    layout = native.PAGED_KEYS_TRANSPOSED if isa in ("vec", "vec16") else native.PAGED_AMX

    def vllm_op():  # a vanilla layer (its own K and V) or a Lite layer (K of layer n, V of layer 1): the same call
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=caches[0][0], value_cache=caches[1][1], output=out, query_start_loc=qsl,
            seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
            softcap=0.0, scheduler_metadata=meta, s_aux=None, kv_cache_dtype="auto")

    def native_call(n: int):
        return lambda: native_paged_attention(q, [c[0] for c in caches[:n]], weights[:n], [c[1] for c in caches[:n]],
                                              weights[:n], rows, table, scale, layout, out)

    calls = {"vLLM op (vanilla, Lite)": vllm_op, "native, 2+2 sources (FusedKV)": native_call(2),
             "native, 1+1 source": native_call(1)}
    # (a tree from before `paged_loops`, timed for a before/after comparison, has no report of its loops)
    loops = native.paged_loops(dtype, layout, D, bs) if hasattr(native, "paged_loops") else "not reported"
    for fn in calls.values():  # warm-up
        fn()
    times = {name: [] for name in calls}
    for r in range(args.rounds):
        names = list(calls)
        for name in names[r % len(names):] + names[:r % len(names)]:
            t = time.process_time()
            for _ in range(args.calls):
                calls[name]()
            times[name].append(1e3 * (time.process_time() - t) / args.calls)
    base = times["vLLM op (vanilla, Lite)"]
    print(f"{processor()}; vLLM ISA {isa!r}; native kernel layout {layout}, loops (scores, values) {loops}\n"
          f"decode, batch {B} x {L} keys, {H} query / {H_kv} key-value heads of {D}, blocks of {bs}, {args.dtype} "
          f"cache, 1 thread; CPU ms per layer call, medians of {args.rounds} rotated rounds of {args.calls} calls\n")
    print("| call | ms | vs vLLM's op per round | median |\n|---|---|---|---|")
    result = {}
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts, base)]
        result[name] = {"ms_per_round": ts, "median_ms": statistics.median(ts), "ratio_per_round": ratios}
        print(f"| {name} | {statistics.median(ts):.3f} | {', '.join(f'{x:.2f}' for x in ratios)} | "
              f"{statistics.median(ratios):.2f}x |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "processor": processor(), "isa": isa, "loops": loops, "calls": result}, f,
                      indent=1)


if __name__ == "__main__":
    main()
