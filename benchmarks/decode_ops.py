"""aten ops per decode step of `generate` (the `fusedkv bench` model shape, batch 1, `weight_layout="auto"`), with
the native step and with the model's modules: a count that does not depend on how loaded the machine is, so two
trees can be compared where timings are noise. Counted as (ops of generating 12 tokens - ops of 4) / 8.

    PYTHONPATH=<tree> OMP_NUM_THREADS=1 python benchmarks/decode_ops.py     # once per tree; compare the lines
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.profiler import profile

import fusedkv
from fusedkv.generation import generate
from fusedkv.speed.inference import BenchShape, build_models

PLANS = ("vanilla", "fusedkv-lite", "fusedkv")


def main() -> None:
    torch.set_num_threads(1)
    models = build_models(BenchShape(), list(PLANS), 64 + 12 + 8, "cpu", torch.float32, include_hf=False)
    ids = torch.randint(1, 8000, (1, 64), generator=torch.Generator().manual_seed(0))
    out = {"tree": str(Path(fusedkv.__file__).resolve().parents[1])}
    for plan in PLANS:
        for native in (True, False):
            generate(models[plan], ids, 4, weight_layout="auto", native_step=native)  # layout, kernels
            counts = []
            for n in (4, 12):
                with profile() as prof:
                    generate(models[plan], ids, n, weight_layout="auto", native_step=native)
                counts.append(sum(e.count for e in prof.key_averages()))
            out[f"{plan}|{'native step' if native else 'modules'}"] = (counts[1] - counts[0]) / 8
    print(json.dumps(out))


if __name__ == "__main__":
    main()
