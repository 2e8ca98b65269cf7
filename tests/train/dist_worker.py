"""Run under `torchrun --nproc_per_node=2`: every two-rank check of tests/train in one launch (each launch
spends seconds importing torch and fusedkv in every process): train the nano preset with DDP and then with
FSDP2 (test_distributed.py), then the sharded-checkpoint suite of dcp_worker.py (test_dcp.py), in the same
two processes (one process group, created here).

usage: dist_worker.py DATA OUT_ROOT STEPS  CKPT REF ROOT_B REF_B   (the last four: `dcp_worker.py suite fsdp`'s)
"""

import json
import sys
from pathlib import Path

import dcp_worker
import torch
import torch.distributed as dist

from fusedkv.train import TrainConfig, train

if __name__ == "__main__":
    data, root, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for mode in ("ddp", "fsdp"):
        # micro-batch 2: each rank accumulates 2 micro-batches (exercises no_sync / deferred sync).
        cfg = TrainConfig(preset="nano", data=data, out_dir=str(root / mode), max_steps=steps,
                          micro_batch_size=2, distributed=mode, progress=False)
        res = train(cfg)
        if dist.get_rank() == 0:
            (root / mode / "losses.json").write_text(json.dumps([r["loss"] for r in res["curve"]]))
    dcp_worker.suite("fsdp", *map(Path, sys.argv[4:8]))
    dist.destroy_process_group()
