"""Checkpoint save time and bytes per rank: the gathered save (rank 0 writes everything) against the
sharded DCP save (every rank writes its own part), blocking and asynchronous.

Run under torchrun (gloo on CPU, nccl on GPU), e.g.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/checkpoint_save.py \
        --presets nano tiny --mode fsdp --repeats 3

For each preset: build the model under `--mode` (ddp or fsdp), take one AdamW step (so the moments
exist), then save it `--repeats` times each way, interleaved:

* gathered: what the trainer's full checkpoints do: full model + optimizer state dicts gathered to
  rank 0 (`distributed.full_*_state_dict`), which writes safetensors + torch.save files.
* sharded: `sharded_checkpoint.ShardedCheckpointer(async_save=False)`: each rank writes its shard, then the manifest.
* sharded async: the same with `dcp.async_save`; "blocked" is how long training waits (staging to
  CPU memory), "total" is until the checkpoint is complete on disk.

Times are the slowest rank's, the median over repeats. Bytes per rank are the files each rank wrote.
Prints a markdown table (and `--json FILE` writes the numbers).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fusedkv import FusedKVConfig, FusedKVForCausalLM
from fusedkv.train import distributed as D
from fusedkv.train import full_checkpoint as ckpt_io
from fusedkv.train.optim import build_optimizer
from fusedkv.train.sharded_checkpoint import DCP_DIR, ShardedCheckpointer, rank_file


def slowest(seconds: float, env) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    if env.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def gathered_save(root: Path, step: int, model, opt, env) -> tuple[float, int]:
    D.barrier(env)
    t0 = time.perf_counter()
    model_sd = D.full_model_state_dict(model)
    optim_sd = D.full_optimizer_state_dict(model, opt)
    written = 0
    if env.is_main:
        path = ckpt_io.save_checkpoint(root, step, model_sd, optim_sd, {"step": step}, {}, {}, keep=1)
        written = sum(p.stat().st_size for p in path.iterdir())
    D.barrier(env)
    return slowest(time.perf_counter() - t0, env), written


def sharded_save(ckpt: ShardedCheckpointer, step: int, model, opt, env) -> tuple[float, float, int]:
    D.barrier(env)
    t0 = time.perf_counter()
    path = ckpt.save(step, model, opt, {"step": step}, {"rng": ckpt_io.capture_rng()}, {}, {}, keep=1)
    blocked = time.perf_counter() - t0
    ckpt.wait()
    total = time.perf_counter() - t0
    mine = [path / rank_file(env.rank)] + [p for p in (path / DCP_DIR).iterdir() if p.name.startswith(f"__{env.rank}_")]
    if env.is_main:
        mine += [path / DCP_DIR / ".metadata", path / "trainer_state.pt", path / "manifest.json"]
    return slowest(blocked, env), slowest(total, env), sum(p.stat().st_size for p in mine)


def bench_preset(preset: str, sets: list[str], mode: str, repeats: int, out: Path, env,
                 label: str | None = None) -> dict:
    from fusedkv.train.config import resolve_config

    cfg = resolve_config(overrides=sets, preset=preset, data="builtin", progress=False)
    mc = FusedKVConfig(vocab_size=cfg.vocab_size, kv_sharing="fusedkv", **cfg.model)
    torch.manual_seed(0)
    model = FusedKVForCausalLM(mc).to(env.device).train()
    wrapped = D.wrap_model(model, env)
    opt = build_optimizer(model, cfg)
    x = torch.randint(0, mc.vocab_size, (1, min(cfg.seq_len, 64)), device=env.device)
    F.cross_entropy(wrapped(input_ids=x, use_cache=False).logits.flatten(0, 1), x.flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    params = sum(p.numel() for p in D.full_model_state_dict(model).values())
    sync = ShardedCheckpointer(out / preset / "sharded", env.rank, env.world_size, async_save=False)
    asyn = ShardedCheckpointer(out / preset / "async", env.rank, env.world_size, async_save=True)
    rows = {"gathered": [], "sharded": [], "async_blocked": [], "async_total": []}
    bytes_per_rank = {}
    for r in range(repeats):
        t, b = gathered_save(out / preset / "gathered", r + 1, model, opt, env)
        rows["gathered"].append(t)
        bytes_per_rank["gathered"] = b
        _, t, b = sharded_save(sync, r + 1, model, opt, env)
        rows["sharded"].append(t)
        bytes_per_rank["sharded"] = b
        blocked, total, b = sharded_save(asyn, r + 1, model, opt, env)
        rows["async_blocked"].append(blocked)
        rows["async_total"].append(total)
        bytes_per_rank["async"] = b
    sync.close()
    asyn.close()
    gathered_bytes = [None] * env.world_size
    if env.world_size > 1:
        dist.all_gather_object(gathered_bytes, bytes_per_rank)
    else:
        gathered_bytes = [bytes_per_rank]
    return {
        "preset": label or preset + (" (" + ", ".join(sets) + ")" if sets else ""),
        "params": params,
        "mode": mode,
        "world_size": env.world_size,
        "median_s": {k: statistics.median(v) for k, v in rows.items()},
        "bytes_per_rank": {k: [b[k] for b in gathered_bytes] for k in ("gathered", "sharded", "async")},
    }


def table(results: list[dict]) -> str:
    lines = [
        "| preset | params | ranks | save | time (s) | training blocked (s) | bytes per rank |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s, b = r["median_s"], r["bytes_per_rank"]
        mb = lambda xs: " / ".join(f"{x / 1e6:.1f} MB" for x in xs)  # noqa: E731
        base = f"| {r['preset']} | {r['params'] / 1e6:.2f}M | {r['world_size']} ({r['mode']})"
        lines.append(f"{base} | gathered to rank 0 | {s['gathered']:.3f} | {s['gathered']:.3f} | {mb(b['gathered'])} |")
        lines.append(f"{base} | sharded (DCP) | {s['sharded']:.3f} | {s['sharded']:.3f} | {mb(b['sharded'])} |")
        lines.append(f"{base} | sharded, async | {s['async_total']:.3f} | {s['async_blocked']:.3f} | "
                     f"{mb(b['async'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["nano", "tiny"])
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="TrainConfig overrides for every preset (e.g. model.hidden_size=512)")
    p.add_argument("--label", help="name of the row(s) in the table (default: the preset and the overrides)")
    p.add_argument("--mode", choices=("ddp", "fsdp"), default="fsdp")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="where to write (default: a temporary directory, removed afterwards)")
    p.add_argument("--json", help="also write the results as JSON here (rank 0)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    env = D.setup(args.mode, "auto")
    try:
        with tempfile.TemporaryDirectory(dir=args.out) as tmp:
            root = Path(tmp)
            if env.world_size > 1:  # every rank writes into rank 0's temporary directory
                box = [str(root)]
                dist.broadcast_object_list(box, src=0)
                root = Path(box[0])
            results = [bench_preset(pr, args.sets, args.mode, args.repeats, root, env, args.label)
                       for pr in args.presets]
            D.barrier(env)
    finally:
        D.teardown(env)
    if env.is_main:
        print(table(results))
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
