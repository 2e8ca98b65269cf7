"""Checkpoint import: peak memory and time of `fusedkv.convert`'s shard streaming against reading every
tensor at once (what import did before: the whole state dict, plus a randomly initialised model to copy it
into), on a sharded random Llama checkpoint built here with transformers' class.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/convert_memory.py --hidden 1024 --layers 12 --shard 100MB

Each mode runs in its own process (peak RSS from `resource.getrusage`), `--rounds` times in alternating
order; the table gives medians, the memory above the process's baseline after imports, and per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(mode: str, src: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from fusedkv import FusedKVForCausalLM
    from fusedkv.convert import family_for, load_state_dict, model_from_shards
    from fusedkv.convert.core import read_shard, shard_files

    hf = json.loads((src / "config.json").read_text())
    family = family_for(hf)
    config = family.to_config(hf, "vanilla")
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if mode == "whole":
        state = load_state_dict(src)
        model = FusedKVForCausalLM(config)
        model.load_state_dict(state, strict=False)
    else:
        model = model_from_shards((read_shard(f) for f in shard_files(src)), config, family.prepare_state, str(src))
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"seconds": seconds, "peak_mb": peak / 1024, "above_mb": (peak - base) / 1024,
                      "model_mb": params / 2**20}))


def build(path: Path, hidden: int, layers: int, shard: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu")
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    model.save_pretrained(path, max_shard_size=shard)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--shard", default="100MB")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--build", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child[0], Path(args.child[1]))
    if args.build:
        return build(Path(args.build), args.hidden, args.layers, args.shard)
    # This process stays small: Linux carries a parent's peak RSS into a child's ru_maxrss across exec.
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "llama"
        subprocess.run([sys.executable, __file__, "--build", str(src), "--hidden", str(args.hidden), "--layers",
                        str(args.layers), "--shard", args.shard], check=True, capture_output=True)
        shards = len(list(src.glob("*.safetensors")))
        runs: dict[str, list[dict]] = {"stream": [], "whole": []}
        for r in range(args.rounds):
            for mode in (("stream", "whole") if r % 2 == 0 else ("whole", "stream")):
                out = subprocess.run([sys.executable, __file__, "--child", mode, str(src)], capture_output=True,
                                     text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
                runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    model_mb = runs["stream"][0]["model_mb"]
    print(f"Llama hidden {args.hidden}, {args.layers} layers: {model_mb:.0f} MB of fp32 weights in {shards} shards "
          f"of <= {args.shard}; medians of {args.rounds} rounds\n")
    print("| import | time (s) | peak RSS (MB) | above baseline (MB) | above / model size |")
    print("|---|---|---|---|---|")
    for mode in ("stream", "whole"):
        med = {k: statistics.median(r[k] for r in runs[mode]) for k in ("seconds", "peak_mb", "above_mb")}
        print(f"| {mode} | {med['seconds']:.1f} | {med['peak_mb']:.0f} | {med['above_mb']:.0f} | "
              f"{med['above_mb'] / model_mb:.2f} |")
    ratios = [w["above_mb"] / s["above_mb"] for s, w in zip(runs["stream"], runs["whole"], strict=True)]
    times = [w["seconds"] / s["seconds"] for s, w in zip(runs["stream"], runs["whole"], strict=True)]
    print(f"\nwhole / stream per round: memory above baseline {', '.join(f'{x:.2f}' for x in ratios)}; "
          f"time {', '.join(f'{x:.2f}' for x in times)}")


if __name__ == "__main__":
    main()
