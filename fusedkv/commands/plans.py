"""`fusedkv plans`: the KV-sharing plans with their cache capacity and I/O for a model shape (paper Table 1)."""

from __future__ import annotations

from .. import argtypes
from ..config import FusedKVConfig
from ..plan import CHOICE_DESCRIPTIONS, PLAN_CHOICES, PLAN_NAMES, build_plan, resolve_plan_choice
from ..utils import human_bytes


def register(sub) -> None:
    p = sub.add_parser("plans", help="print the KV-sharing plans with cache capacity and I/O",
                       description="Cache capacity and per-step cache I/O of every plan, relative to vanilla "
                       "multi-head attention with the same number of query heads (paper Table 1).")
    p.add_argument("--layers", type=argtypes.int_range(2, 4096), default=16,
                   help="num_hidden_layers (default 16)")
    p.add_argument("--heads", type=argtypes.int_range(1, 4096), default=16, help="num_attention_heads (default 16)")
    p.add_argument("--kv-heads", type=argtypes.int_range(1, 4096), default=None,
                   help="KV heads for non-GQA plans, dividing --heads (default: --heads)")
    p.add_argument("--head-dim", type=argtypes.int_range(2, 4096), default=128,
                   help="head_dim, even for RoPE (default 128)")
    p.add_argument("--seq-len", type=argtypes.positive_int, default=8192,
                   help="context length for the bytes column (default 8192)")
    p.add_argument("--bytes", type=argtypes.int_range(1, 8), default=2,
                   help="bytes per element (2 for bf16/fp16, 4 for fp32)")
    p.add_argument("--layout", action="store_true", help="also print each plan's per-layer source map")
    p.set_defaults(func=run)


def plans_table(layers: int, heads: int, kv_heads: int | None, head_dim: int, seq_len: int, nbytes: int) -> str:
    rows = ["| plan | storage layers | KV heads | cache vs MHA | cache I/O vs MHA | bytes/token | "
            f"cache at {seq_len} tokens | what it does |", "|---|---|---|---|---|---|---|---|"]
    for name in PLAN_CHOICES:
        c = FusedKVConfig(num_hidden_layers=layers, num_attention_heads=heads, head_dim=head_dim,
                          hidden_size=heads * head_dim, **resolve_plan_choice(name).config_kwargs(heads, kv_heads))
        plan = c.plan
        per_token = c.kv_cache_bytes_per_token(nbytes)
        io = plan.elements_read_per_token() * c.num_key_value_heads / (2 * layers * heads)
        rows.append(
            f"| {name} | {len(plan.storage_layers)}/{layers} | {c.num_key_value_heads} | "
            f"{c.kv_cache_fraction():.3g} | {io:.3g} | {per_token:,} | {human_bytes(per_token * seq_len)} | "
            f"{CHOICE_DESCRIPTIONS[name]} |"
        )
    return "\n".join(rows)


def run(args) -> None:
    print(plans_table(args.layers, args.heads, args.kv_heads, args.head_dim, args.seq_len, args.bytes))
    if args.layout:  # KV-head counts do not change the layout: the sharing plans alone
        for name in PLAN_NAMES:
            print(f"\n{name}:")
            for line in build_plan(name, args.layers).describe():
                print("  " + line)
