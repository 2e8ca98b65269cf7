"""Time of one MLA decode step: absorbed (the latent cache read as it is) against expanded attention.

One MLA attention layer (`fusedkv.model.mla.MLA`) decodes one token over a cached context of S tokens:
  * expanded: kv_b_proj turns every cached latent into per-head keys and values, then SDPA; what
              transformers' DeepSeek-V3 attention does each step (it caches the latent, expands on use).
  * absorbed: W_UK folded into the query and W_UV into the output; attention runs over the [S, r]
              latent directly, and nothing per head of size S is written.
Two layer kinds: a plain MLA layer (one latent, one RoPE key: the vanilla and YOCO case) and a FusedKV
reconstruction layer (two latents and two RoPE keys with learned weights). Outputs are checked equal
before timing; variants are timed interleaved in one process (medians; ratio expanded / absorbed).

The default shape is the paper's 650M MLA model (App. A.6: 16 heads, latent rank 736, q rank 864,
RoPE head dim 32); qk_nope_head_dim = v_head_dim = 96 is an assumption (hidden 1536 / 16 heads).

    python benchmarks/mla_decode.py
    python benchmarks/mla_decode.py --threads 2 --contexts 512,2048,8192 --batches 1,8 --layers fused
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fusedkv import FusedKVConfig
from fusedkv.engine.backends import AbsorbedMLA
from fusedkv.model.attention import KVState
from fusedkv.model.layers import rope_cos_sin
from fusedkv.model.mla import MLA


def build(plan: str, args) -> tuple[MLA, FusedKVConfig]:
    torch.manual_seed(0)
    cfg = FusedKVConfig(hidden_size=args.hidden, num_attention_heads=args.heads, num_hidden_layers=2,
                        kv_lora_rank=args.kv_rank, q_lora_rank=args.q_rank, qk_nope_head_dim=args.nope,
                        qk_rope_head_dim=args.rope, v_head_dim=args.v, kv_sharing=plan,
                        intermediate_size=4 * args.hidden, max_position_embeddings=65536)
    layer = MLA(cfg, cfg.plan.layers[1]).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.uniform_(0.5, 1.0)
    return layer, cfg


def timed(fns: dict, repeats: int) -> dict[str, float]:
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():  # interleaved
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-rank", type=int, default=736)
    ap.add_argument("--q-rank", type=int, default=864)
    ap.add_argument("--nope", type=int, default=96)
    ap.add_argument("--rope", type=int, default=32)
    ap.add_argument("--v", type=int, default=96)
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--layers", default="plain,fused", help="which layer kinds to time")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# one MLA layer, one-token decode step: hidden {args.hidden}, {args.heads} heads, latent {args.kv_rank}, "
          f"q rank {args.q_rank}, nope/rope/v {args.nope}/{args.rope}/{args.v}; fp32, {args.threads} thread(s), "
          f"torch {torch.__version__}; medians of {args.repeats}, interleaved")
    print(f"{'layer':>10} {'B':>3} {'S':>6} {'expanded ms':>12} {'absorbed ms':>12} {'expanded/absorbed':>18} "
          f"{'latent MB':>10} {'expanded K/V MB':>16}")
    kinds = args.layers.split(",")
    for plan, kind in [(p, k) for p, k in (("yoco", "plain"), ("fusedkv", "fused")) if k in kinds]:
        layer, cfg = build(plan, args)
        sources = layer.layer.sources
        for b in [int(x) for x in args.batches.split(",")]:
            for s in [int(x) for x in args.contexts.split(",")]:
                kv = KVState()
                for src in sources:
                    kv.layers[src] = (torch.randn(b, 1, s, args.kv_rank), torch.randn(b, 1, s, args.rope))
                x = torch.randn(b, 1, args.hidden)
                cos, sin = rope_cos_sin(torch.full((b, 1), s - 1), cfg.head_dim, cfg.rope_theta, torch.float32)

                def step(path, x=x, cos=cos, sin=sin, kv=kv, layer=layer):
                    layer.use(None if path == "materialized" else AbsorbedMLA(float("inf")))
                    return layer(x, cos, sin, None, kv)

                with torch.inference_mode():
                    err = (step("materialized") - step("factored")).abs().max().item()
                    assert err < 1e-4, f"absorbed differs from expanded by {err}"
                    med = timed({"expanded": lambda: step("materialized"),  # noqa: B023
                                 "absorbed": lambda: step("factored")}, args.repeats)  # noqa: B023
                latent_mb = len(sources) * b * s * (args.kv_rank + args.rope) * 4 / 2**20
                expanded_mb = b * s * args.heads * (args.nope + args.rope + args.v) * 4 / 2**20
                print(f"{kind:>10} {b:>3} {s:>6} {med['expanded'] * 1e3:>12.3f} {med['absorbed'] * 1e3:>12.3f} "
                      f"{med['expanded'] / med['absorbed']:>18.2f} {latent_mb:>10.1f} {expanded_mb:>16.1f}",
                      flush=True)


if __name__ == "__main__":
    main()
