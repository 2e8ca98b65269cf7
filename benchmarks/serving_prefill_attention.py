"""CPU micro-benchmark: one prefill chunk of a FusedKV reconstruction layer served by vLLM, by every route.

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/serving_prefill_attention.py [--tokens 1024] [--kv-heads 4]

(the vLLM environment's Python, with PYTHONPATH at this checkout). One request whose chunk is its whole
sequence (`--tokens` rows; and one that starts mid-sequence, its last `--mid` rows), the long workload's
layer shape (4 query heads of 64, `--kv-heads`), vLLM's CPU cache layout for the dtype, block size 32, one
thread; CPU ms per call, the best of `--repeats`:

  * vLLM's op, one K and one V source: what a normal layer (vanilla) and Lite's upper layers (K^n, V^1) pay;
  * FusedKV, gathered + factored: each source's blocks copied, two score products over the whole chunk, a full
    masked softmax, two P V products (the route before `fused_chunk_attention`);
  * FusedKV, fused + SDPA over the rows of the step: the whole-sequence route (`StorageAttention`'s rows);
  * FusedKV, gathered + fused + SDPA: the same over copied blocks (the mid-sequence route, here whole);
  * FusedKV, the step's fused rows written to a scratch paged cache, then vLLM's op: the alternative to SDPA;
  * Lite by SDPA over the rows of the step: whether Lite's prefill would gain by the same route;
  * the mid-sequence chunk, gathered + factored against gathered + fused + SDPA (its mask).
"""

from __future__ import annotations

import argparse
import time

import torch


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return 1e3 * best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--mid", type=int, default=256, help="rows of the mid-sequence chunk (its last rows)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from fusedkv.kernels.reference import factored_attention
    from fusedkv.model.attention import ReferenceAttention
    from fusedkv.model.fusion import KVSources
    from fusedkv.serving.paged_blocks import block_layout, gather_blocks, split_cpu_kv_cache
    from fusedkv.serving.paged_gathered import attend_chunk

    def fused_chunk_attention(q, keys, kw, values, vw, scale):
        """A chunk over [s, H_kv, D] rows as a served layer attends it (`attend_chunk`: the model's attention)."""
        sources = KVSources(tuple(k.transpose(0, 1)[None] for k in keys), tuple(kw),
                            tuple(v.transpose(0, 1)[None] for v in values), tuple(vw))
        attention = ReferenceAttention(scale, q.shape[1] != keys[0].shape[1])
        return attend_chunk(q, sources, keys[0].shape[0], 0, attention, None)

    torch.manual_seed(0)
    # A bf16 product first: oneDNN asks the kernel for the AMX tile state, which vLLM's "amx" op assumes was
    # granted (in an engine something has done so before the first step); without it the op died with SIGILL.
    torch.ones(32, 32, dtype=torch.bfloat16) @ torch.ones(32, 32, dtype=torch.bfloat16)
    t, h, h_kv, d, bs = args.tokens, args.heads, args.kv_heads, 64, 32
    dtype = getattr(torch, args.dtype)
    isa = _get_attn_isa(dtype, bs, d)
    layout = block_layout(isa, dtype, bs, d)
    n_blocks = -(-t // bs)
    block_table = torch.arange(n_blocks, dtype=torch.int32)[None]
    rows, caches = [], []
    for _ in range(2):  # layer 1 and layer n: their rows of the step and their caches
        k, v = torch.randn(t, h_kv, d).to(dtype), torch.randn(t, h_kv, d).to(dtype)
        kv = torch.zeros(n_blocks, h_kv, bs, 2 * d, dtype=dtype)
        key_cache, value_cache = split_cpu_kv_cache(kv)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, torch.arange(t), isa)
        rows.append((k, v))
        caches.append((key_cache, value_cache))
    q = torch.randn(t, h, d).to(dtype)
    kw = [torch.rand(h_kv, d) + 0.5 for _ in range(2)]
    vw = [torch.rand(h_kv, d) + 0.5 for _ in range(2)]
    scale = d**-0.5
    starts, seq_lens = torch.tensor([0, t], dtype=torch.int32), torch.tensor([t], dtype=torch.int32)
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=h, num_kv_heads=h_kv, head_dim=d, seq_lens=seq_lens, dtype=dtype,
        query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
        dynamic_causal=None, kv_cache_dtype="auto")

    def vllm_op():
        out = torch.empty_like(q)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=caches[1][0], value_cache=caches[0][1], output=out, query_start_loc=starts,
            seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=block_table, softcap=0.0, scheduler_metadata=sched, s_aux=None, dynamic_causal=None,
            k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        return out

    def gathered():
        """Each source's blocks copied: [t, H_kv, D] rows."""
        return ([gather_blocks(kc, block_table, layout[0])[0, :, :t].transpose(0, 1) for kc, _ in caches],
                [gather_blocks(vc, block_table, layout[1])[0, :, :t].transpose(0, 1) for _, vc in caches])

    def factored(first: int):
        keys, values = gathered()
        mask = torch.arange(t)[None, :] <= torch.arange(first, t)[:, None]
        return factored_attention(q[first:].transpose(0, 1)[None], [k.transpose(0, 1)[None] for k in keys], kw,
                                  [v.transpose(0, 1)[None] for v in values], vw, mask=mask, scale=scale)

    def gathered_sdpa(first: int):
        keys, values = gathered()
        return fused_chunk_attention(q[first:], keys, kw, values, vw, scale)

    def scratch_op():
        k = (rows[0][0] * kw[0].to(dtype)).add_(rows[1][0] * kw[1].to(dtype))  # [t, H_kv, D]
        v = (rows[0][1] * vw[0].to(dtype)).add_(rows[1][1] * vw[1].to(dtype))
        kv = torch.empty(n_blocks, h_kv, bs, 2 * d, dtype=dtype)
        key_cache, value_cache = split_cpu_kv_cache(kv)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, torch.arange(t), isa)
        out = torch.empty_like(q)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts,
            seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=block_table, softcap=0.0, scheduler_metadata=sched, s_aux=None, dynamic_causal=None,
            k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        return out

    routes = {
        "FusedKV, fused rows written to a scratch cache + vLLM's op": scratch_op,
        "vLLM's op, one K + one V source (a normal layer; Lite)": vllm_op,
        "FusedKV, gathered + factored (before)": lambda: factored(0),
        "FusedKV, fused + SDPA over the step's rows (whole sequence)":
            lambda: fused_chunk_attention(q, [r[0] for r in rows], kw, [r[1] for r in rows], vw, scale),
        "FusedKV, gathered + fused + SDPA": lambda: gathered_sdpa(0),
        "Lite, SDPA over the step's rows": lambda: fused_chunk_attention(q, [rows[1][0]], [None], [rows[0][1]],
                                                                          [None], scale),
        f"mid-sequence chunk ({args.mid} rows), gathered + factored (before)": lambda: factored(t - args.mid),
        f"mid-sequence chunk ({args.mid} rows), gathered + fused + SDPA": lambda: gathered_sdpa(t - args.mid),
    }
    print(f"## One prefill chunk, CPU ms ({t} tokens, {h} query / {h_kv} key-value heads of {d}, {args.dtype}, "
          f"vLLM ISA {isa!r}, {torch.get_num_threads()} thread(s), best of {args.repeats})\n")
    print("| route | ms |\n|---|---|")
    for name, fn in routes.items():
        print(f"| {name} | {best_ms(fn, args.repeats):.2f} |")


if __name__ == "__main__":
    main()
