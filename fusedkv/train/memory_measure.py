"""The memory estimate checked against the real thing: the peak bytes of a steady-state training step on CPU,
measured with torch's memory profiler (`measure_peak_cpu`), next to the estimate for exactly that step
(`single_process_estimate`, `fusedkv.train.memory_estimate`). What the tests hold the estimate to."""

from __future__ import annotations

import math

import torch

from ..config import FusedKVConfig
from .config import TrainConfig
from .memory_counts import Teacher, count_parameters, model_config
from .memory_estimate import MemoryEstimate, estimate


def measure_peak_cpu(cfg: TrainConfig, checkpointing: bool = False, model: FusedKVConfig | None = None,
                     teacher: str | None = None) -> dict:
    """Peak bytes of a steady-state training step (forward + backward over the micro-batches, clipping,
    AdamW step) of `cfg` in one CPU process, fp32, measured with the profiler's memory timeline. `model`
    replaces the preset's model; `teacher` (a checkpoint directory) makes the loss the distillation's.

    A first step runs unprofiled so AdamW's moments exist (as in every later step); the profiled step's
    timeline starts from the tensors alive then (weights, moments) and replays every allocation and free.
    Returns {"peak": bytes, "by_category": {category: bytes at the peak}}."""
    import json
    import tempfile
    import warnings
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    from ..model import FusedKVForCausalLM
    from ..model.loss import lm_loss
    from .optim import build_optimizer

    mc = model_config(cfg) if model is None else model
    torch.manual_seed(cfg.seed)
    model = FusedKVForCausalLM(mc).train()
    if checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    distiller = None
    if teacher is not None:
        from .distill import Distiller

        distiller = Distiller(teacher, mc, "cpu", cfg.distill_alpha, cfg.distill_temperature,
                              cfg.distill_hidden_weight)
    opt = build_optimizer(model, cfg)
    accum, mb = cfg.grad_accum_steps(1), cfg.micro_batch_size
    gen = torch.Generator().manual_seed(cfg.seed)

    def step():
        for _ in range(accum):
            x, y = torch.randint(0, mc.vocab_size, (2, mb, cfg.seq_len), generator=gen).unbind(0)
            x, y = x.contiguous(), y.contiguous()
            if distiller is not None:
                loss = distiller(model, x, y)
            else:
                logits = model(input_ids=x, use_cache=False).logits
                loss = lm_loss(logits, y)
                del logits
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "timeline.json"
        with warnings.catch_warnings():  # deprecated for CUDA in favour of memory snapshots; none on CPU
            warnings.simplefilter("ignore", FutureWarning)
            prof.export_memory_timeline(str(path), device="cpu")
        times, sizes = json.loads(path.read_text())
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX

    names = {index + 1: (c.name.lower() if c is not None else "unknown") for c, index in _CATEGORY_TO_INDEX.items()}
    totals = [sum(row[1:]) for row in sizes]
    at = max(range(len(totals)), key=totals.__getitem__)
    by_category = {names[j]: v for j, v in enumerate(sizes[at]) if j in names and v}
    return {"peak": float(totals[at]), "by_category": by_category}


def single_process_estimate(cfg: TrainConfig, checkpointing: bool = False, model: FusedKVConfig | None = None,
                            teacher: Teacher | None = None) -> MemoryEstimate:
    """The plan for what `measure_peak_cpu` measures: one process, fp32."""
    mc = model_config(cfg) if model is None else model
    return estimate(mc, count_parameters(mc), mode="single", world=1, seq_len=cfg.seq_len,
                    micro_batch=cfg.micro_batch_size, accum=cfg.grad_accum_steps(1), dtype="float32",
                    checkpointing=checkpointing, teacher=teacher)


def relative_error(plan_bytes: float, measured: float) -> float:
    return abs(plan_bytes - measured) / measured if measured else math.inf
