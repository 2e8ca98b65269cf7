"""Time of one sparse MoE MLP: grouped dispatch (`fusedkv.model.moe.SparseMoE`) against naive versions.

Three implementations over the same weights and the same routing, checked equal before timing:
  * grouped:  fusedkv's SparseMoE: (token, slot) pairs sorted by expert, one grouped GEMM per
              projection over the contiguous blocks (`torch.nn.functional.grouped_mm`), one index_add_.
  * hf-eager: transformers' Qwen3MoeSparseMoeBlock with its eager experts: a Python loop over the
              experts that were hit, each gathering its tokens through a boolean mask.
  * dense:    every expert over every token, outputs weighted by the (mostly zero) routing weights:
              no dispatch at all, E/k times the FLOPs.
Timed interleaved in one process (medians; ratios to grouped), forward at inference for a decode
batch and for prefill-sized blocks, and forward + backward for a training block.

    python benchmarks/moe_dispatch.py                    # the paper's MoE shape family: 8 experts, top-2
    python benchmarks/moe_dispatch.py --threads 2 --tokens 1,8,512,4096 --experts 8 --top-k 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from fusedkv.model.moe import SparseMoE


def dense_moe(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    _, weights, experts = block.route(x)
    full = torch.zeros(x.shape[0], block.experts.num_experts, dtype=x.dtype).scatter_(1, experts, weights)
    gate, up = torch.einsum("th,eih->eti", x, block.experts.gate_up_proj).chunk(2, dim=-1)
    y = torch.einsum("eti,ehi->eth", F.silu(gate) * up, block.experts.down_proj)
    return torch.einsum("eth,te->th", y, full)


def build(hidden: int, inter: int, experts: int, top_k: int):
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                         num_experts_per_tok=top_k, norm_topk_prob=True)
    cfg._experts_implementation = "eager"
    hf = Qwen3MoeSparseMoeBlock(cfg)
    ours = SparseMoE(type("C", (), dict(hidden_size=hidden, num_experts=experts, num_experts_per_tok=top_k,
                                        moe_intermediate_size=inter, norm_topk_prob=True)))
    ours.experts.grouped = True  # what `fusedkv.engine.select_runtime` sets where grouped_mm takes the dtype
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.05)
        hf.gate.weight.copy_(ours.gate.weight)
        hf.experts.gate_up_proj.copy_(ours.experts.gate_up_proj)
        hf.experts.down_proj.copy_(ours.experts.down_proj)
    return ours, hf


def timed(fns: dict, repeats: int) -> dict[str, float]:
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():  # interleaved, so machine noise hits every variant alike
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=512, help="moe_intermediate_size")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tokens", default="1,8,512,4096")
    ap.add_argument("--train-tokens", type=int, default=2048, help="rows of the forward+backward row (0: skip)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ours, hf = build(args.hidden, args.intermediate, args.experts, args.top_k)
    print(f"# MoE MLP, hidden {args.hidden}, {args.experts} experts of {args.intermediate}, top-{args.top_k}, fp32, "
          f"{args.threads} thread(s), torch {torch.__version__}; medians of {args.repeats}, interleaved")
    print(f"{'tokens':>7} {'pass':>8} {'grouped ms':>11} {'hf-eager ms':>12} {'dense ms':>9} "
          f"{'hf-eager/grouped':>17} {'dense/grouped':>14}")
    for n in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(1, n, args.hidden)
        with torch.inference_mode():
            ref = ours(x)[0]
            for name, out in (("hf-eager", hf(x)), ("dense", dense_moe(ours, x[0])[None])):
                err = (out - ref).abs().max().item()
                assert err < 1e-4, f"{name} differs from grouped by {err}"
            med = timed({"grouped": lambda: ours(x), "hf-eager": lambda: hf(x),  # noqa: B023
                         "dense": lambda: dense_moe(ours, x[0])}, args.repeats)  # noqa: B023
        _row(n, "forward", med)
    if args.train_tokens:
        x = torch.randn(1, args.train_tokens, args.hidden)
        upstream = torch.randn_like(x)

        def step(fn):
            out = fn(x)
            (out[0] if isinstance(out, tuple) else out).mul(upstream).sum().backward()

        med = timed({"grouped": lambda: step(ours), "hf-eager": lambda: step(hf),
                     "dense": lambda: step(lambda v: dense_moe(ours, v[0]))}, max(3, args.repeats // 3))
        _row(args.train_tokens, "fwd+bwd", med)


def _row(n: int, kind: str, med: dict[str, float]) -> None:
    g = med["grouped"]
    print(f"{n:>7} {kind:>8} {g * 1e3:>11.3f} {med['hf-eager'] * 1e3:>12.3f} {med['dense'] * 1e3:>9.3f} "
          f"{med['hf-eager'] / g:>17.2f} {med['dense'] / g:>14.2f}", flush=True)


if __name__ == "__main__":
    main()
