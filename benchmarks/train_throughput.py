"""Training throughput of every KV-sharing plan at the same size: forward + backward + AdamW step.

All plans are measured in ONE process, interleaved: each repeat runs a few timed steps of every
plan in turn (round-robin, with the order rotated every repeat), so slow drifts of the machine
(other jobs, thermal limits, allocator state) hit every plan alike; the table reports the median
over repeats. The step is the trainer's own: `fusedkv.train.compute_loss` and the AdamW built by
`fusedkv.train.optim.build_optimizer` (decay groups, foreach), on random tokens.

    python benchmarks/train_throughput.py                      # small CPU size, ~3 minutes
    python benchmarks/train_throughput.py --layers 12 --hidden 1024 --heads 16 --seq 2048 --batch 8 \
        --device cuda --dtype bfloat16                         # a GPU at a paper-like width

Target: FusedKV >= 0.95 x vanilla tokens/s (its upper layers drop the K/V projections but add the
element-wise fusion of two sources and its backward).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from fusedkv.config import FusedKVConfig
from fusedkv.model import FusedKVForCausalLM
from fusedkv.plan import COMPARED_PLANS, VANILLA
from fusedkv.train import TrainConfig, compute_loss
from fusedkv.train.optim import build_optimizer


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plans", nargs="+", default=list(COMPARED_PLANS), choices=COMPARED_PLANS)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--heads", type=int, default=4, help="even, so that gqa really halves the KV heads")
    p.add_argument("--ffn", type=int, default=None, help="MLP width (default 3 x hidden)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--repeats", type=int, default=5, help="round-robin rounds (median over these)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per plan per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per plan before measuring")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="autocast dtype (bf16 is ~24x slower on AVX2-only CPUs)")
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    return p.parse_args(argv)


def build(plan: str, a, device) -> tuple[FusedKVForCausalLM, torch.optim.Optimizer]:
    torch.manual_seed(0)
    cfg = FusedKVConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn or 3 * a.hidden,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, max_position_embeddings=a.seq,
        kv_sharing=plan,
    )
    model = FusedKVForCausalLM(cfg).to(device).train()
    if a.compile:
        for layer in model.model.layers:
            layer.compile()
    opt = build_optimizer(model, TrainConfig(preset="tiny", lr=1e-4))  # lr tiny: weights stay sane
    return model, opt


def step(model, opt, x, y, autocast) -> None:
    with autocast():
        loss = compute_loss(model, x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> dict:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)

    def autocast():
        if a.dtype == "bfloat16":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(device)
    y = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(device)
    runs = {plan: build(plan, a, device) for plan in a.plans}
    for model, opt in runs.values():
        for _ in range(a.warmup):
            step(model, opt, x, y, autocast)
    sync(device)
    tokens = a.steps * a.batch * a.seq
    samples: dict[str, list[float]] = {plan: [] for plan in a.plans}
    order = list(a.plans)
    t_all = time.perf_counter()
    for r in range(a.repeats):
        rot = order[r % len(order):] + order[: r % len(order)]  # rotate: no plan always runs first
        for plan in rot:
            model, opt = runs[plan]
            sync(device)
            t0 = time.perf_counter()
            for _ in range(a.steps):
                step(model, opt, x, y, autocast)
            sync(device)
            samples[plan].append(tokens / (time.perf_counter() - t0))
    elapsed = time.perf_counter() - t_all

    base = statistics.median(samples[VANILLA]) if VANILLA in samples else None
    print(f"\nTraining throughput (forward + backward + AdamW), {a.layers} layers, hidden {a.hidden}, "
          f"{a.heads} heads, MLP {a.ffn or 3 * a.hidden}, vocab {a.vocab}, {a.batch} x {a.seq} tokens/step, "
          f"{a.dtype} on {device} ({torch.get_num_threads()} threads); median of {a.repeats} interleaved "
          f"rounds x {a.steps} steps ({elapsed:.0f} s)\n")
    print("| plan | params | KV bytes/token (bf16) | tokens/s (median) | min - max | vs vanilla |")
    print("|---|---:|---:|---:|---:|---:|")
    result = {}
    for plan in a.plans:
        model = runs[plan][0]
        med = statistics.median(samples[plan])
        ratio = med / base if base else float("nan")
        result[plan] = {"tokens_per_s": med, "ratio": ratio, "samples": samples[plan]}
        print(f"| {plan} | {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M | "
              f"{model.config.kv_cache_bytes_per_token(2):,} | {med:,.0f} | "
              f"{min(samples[plan]):,.0f} - {max(samples[plan]):,.0f} | {ratio:.3f} |")
    return result


if __name__ == "__main__":
    main()
