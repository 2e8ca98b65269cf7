"""How much memory a training run needs per GPU, and how long its token budget takes: `fusedkv memory`.

Everything is counted tensor by tensor for *this* model and trainer, not from a generic rule of thumb:

* Parameters are counted exactly, by building the model on the meta device (no memory allocated).
* Training state, bytes per parameter P (mixed precision as in Rajbhandari et al. 2020, "ZeRO",
  Sec. 3.1 / Fig. 1, with fp32 master weights): fp32 weights 4P, fp32 gradients 4P, AdamW's two fp32
  moments 8P (Loshchilov & Hutter 2019). DDP also keeps its fp32 gradient buckets (4P, since the
  trainer does not set `gradient_as_bucket_view`); under bf16 autocast it caches bf16 copies of the
  weights during the forward (2P). FSDP2 (full shard, ZeRO-3) divides weights, gradients and
  optimizer state by the number of GPUs, and holds unsharded bf16 (or fp32) copies of the root
  module (embeddings, final norm, LM head) plus one decoder layer at a time; with gradient
  accumulation it also keeps the *unsharded* gradients between micro-batches (the trainer turns the
  reduce-scatter off with `set_requires_gradient_sync(False)` on all but the last micro-batch).
* Activations: the tensors autograd saves for backward, per token, summed layer by layer as in
  Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", Sec. 4.1,
  which gives 34h + 5as per layer for GPT-3 in fp16), redone for this decoder: RMSNorm (the CPU
  kernel saves its input, the reciprocal RMS, the normalised input and the output), Q/K norms and
  RoPE, fused-attention SDPA (output and log-sum-exp only, no T x T matrix), SwiGLU (gate, up,
  silu(gate), product), and the plan's reconstruction layers, which save only the *new* K/V tensors
  their fusion makes (paper Sec. 3.2, Eq. 4-5: a1 * K^1 + an * K^n; a reused source costs nothing).
  The loss saves the fp32 log-softmax over the vocabulary (T x V per sequence), and its backward
  briefly holds two more T x V buffers: with a 128k vocabulary that dominates everything else.
  Activation checkpointing (per decoder layer, non-reentrant) keeps each layer's input plus the
  storage layers' K/V (the forward's `KVState` holds them for the upper layers), and recomputes one
  layer at a time in backward.
  Mixture-of-experts layers save, per token, the router's fp32 logits and probabilities and, for each
  of its top-k experts, the gathered input, SwiGLU's four tensors and the expert output (plus the shared
  experts' SwiGLU where the config has `n_shared_experts`); latent attention (MLA, DeepSeek-V2 Sec.
  2.1.2) saves the low-rank query path, the latent and its norm, the per-head K/V that kv_b_proj expands,
  and the RoPE'd parts.
* Uptraining (`--uptrain SRC`: the student is SRC converted to the plan, the teacher SRC itself, run
  by transformers, fusedkv.train.distill): the teacher's weights in its own dtype on *every* GPU (the
  trainer does not shard the teacher), counted exactly from transformers' class built on the meta
  device; its forward runs without autograd, so one layer's tensors at a time plus its T x V logits;
  the KL saves the student's tempered log-softmax and the teacher's log-probabilities (two fp32 T x V),
  its backward two more; hidden-state distillation keeps the teacher's L + 1 hidden states.
* Peak = the largest of (a) the start of the loss backward in the last micro-batch (state, gradients
  of earlier micro-batches, all activations, the loss buffers), (b) the optimizer step (weights,
  gradients, moments and the one temporary `torch._foreach_sqrt` of the second moments that foreach
  AdamW makes per parameter group) and (c) when uptraining, the teacher's forward.

The fp32 CPU counts are checked against the real peak of a forward + backward + AdamW step, measured
by `torch.profiler` with `profile_memory=True` (every allocation and free of tensor storage, replayed
by torch's memory profiler; `memory_measure.measure_peak_cpu`), within 10% for the `tiny` and `nano` presets
(tests/train/test_memory_estimate.py). The bf16 counts follow the same tensor list with autocast's dtypes
(fp32 residual stream and norms, bf16 projections and attention) and are not measured here (no GPU).

Time: the token budget divided by (tokens/s per GPU x GPUs). Without a measured throughput, the
model FLOPs per token (6N + 12 L H Q T: Chowdhery et al. 2022, "PaLM", App. B; N counts the experts a
token visits, not all of them; a teacher adds its forward, 2N + 4 L H Q T) and an assumed MFU give
one, labelled as such.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import argtypes
from ..config import FusedKVConfig
from .config import TrainConfig
from .memory_counts import (
    ParamCount,
    Teacher,
    activation_bytes_per_token,
    count_parameters,
    count_teacher,
    model_config,
    teacher_bytes,
)

# The counts are `memory_counts`'; they are named here too, as one entry point for callers and tests.
__all__ = ["MemoryEstimate", "ParamCount", "RunEstimate", "Teacher", "activation_bytes_per_token", "count_parameters",
           "count_teacher", "estimate", "estimate_run", "format_estimate", "model_config", "parse_bytes"]

GB = 1e9
MODES = ("ddp", "fsdp")
def parse_bytes(text: str) -> float:
    """'80GB', '80 GiB', '141e9' -> bytes, by the package's one unit rule (`fusedkv.argtypes.parse_bytes`:
    G = 1e9, GiB = 2**30)."""
    try:
        return float(argtypes.parse_bytes(text))
    except ValueError as e:
        raise ValueError(f"memory {e}") from None


# ---- the estimate ------------------------------------------------------------------------------------
@dataclass
class MemoryEstimate:
    """Bytes per GPU for one parallel layout; `peak` is what must fit."""

    mode: str
    weights: float  # fp32 master weights held by this GPU (sharded under FSDP)
    gathered: float  # unsharded parameter copies in flight (FSDP), or autocast's bf16 weight cache (DDP)
    gradients: float  # fp32 gradients at the optimizer step (+ DDP's buckets)
    gradients_at_loss: float  # gradients alive at the last micro-batch's loss backward
    optimizer: float  # AdamW moments
    activations: float  # saved for backward, one micro-batch
    loss_buffers: float  # the loss backward's T x V gradient buffers (+ bf16 logits)
    optimizer_temp: float  # foreach AdamW's temporary during the step
    recompute: float = 0.0  # one layer's activations rebuilt in backward (activation checkpointing)
    teacher_weights: float = 0.0  # uptraining: the whole teacher on every GPU, in its dtype
    teacher_forward: float = 0.0  # its forward (no autograd): one layer's tensors and its logits
    distill: float = 0.0  # the KL's saved log-probabilities (+ the teacher's hidden states)

    @property
    def state(self) -> float:
        return self.weights + self.optimizer + self.teacher_weights

    @property
    def peak_backward(self) -> float:
        return (self.state + self.gathered + self.gradients_at_loss + self.activations + self.distill
                + self.loss_buffers)

    @property
    def peak_teacher(self) -> float:
        # The teacher runs first in each micro-batch: the student's activations do not exist yet.
        if not self.teacher_forward:
            return 0.0
        return self.state + self.gathered + self.gradients_at_loss + self.teacher_forward

    @property
    def peak_recompute(self) -> float:
        # Deep in backward the loss buffers are gone, gradients are (nearly) all there.
        grads = max(self.gradients_at_loss, self.gradients)
        return (self.state + self.gathered + grads + self.activations + self.distill + self.recompute
                if self.recompute else 0.0)

    @property
    def peak_step(self) -> float:
        return self.state + self.gradients + self.optimizer_temp

    @property
    def peak(self) -> float:
        return max(self.peak_backward, self.peak_recompute, self.peak_step, self.peak_teacher)


@dataclass
class RunEstimate:
    cfg: TrainConfig
    mc: FusedKVConfig
    params: ParamCount
    gpus: int
    gpu_memory: float
    dtype: str
    micro_batch: int
    accum: int
    estimates: dict = field(default_factory=dict)  # (mode, checkpointing) -> MemoryEstimate
    kv_bytes_per_token: int = 0
    kv_bytes_per_token_vanilla: int = 0
    tokens: int = 0
    flops_per_token: float = 0.0
    tokens_per_gpu_s: float | None = None
    throughput_source: str = ""
    teacher: Teacher | None = None


def estimate(mc: FusedKVConfig, params: ParamCount, *, mode: str, world: int, seq_len: int, micro_batch: int,
             accum: int, dtype: str = "float32", checkpointing: bool = False,
             teacher: Teacher | None = None) -> MemoryEstimate:
    """Per-GPU bytes of one training step. mode: "single" (one process), "ddp" or "fsdp"."""
    P = params.total
    bf16 = dtype == "bfloat16"
    tokens = seq_len * micro_batch
    acts = activation_bytes_per_token(mc, dtype, checkpointing)
    batch_bytes = 16 * tokens  # input ids and labels (int64)
    logits = 4 * 2 * mc.vocab_size * tokens + (2 * mc.vocab_size * tokens if bf16 else 0)
    shards = world if mode == "fsdp" else 1
    weights, optimizer, grads = 4 * P / shards, 8 * P / shards, 4 * P / shards
    if mode == "fsdp":
        pbytes = 2 if bf16 else 4
        gathered = pbytes * (params.root + 2 * params.largest_layer) * (world > 1)  # root + layer + prefetch
        # While accumulating, FSDP2 keeps unsharded gradients (no reduce-scatter until the last
        # micro-batch); the sharded .grad only appears at that reduce-scatter.
        at_loss = pbytes * P if accum > 1 else 0.0
    else:
        gathered = 2 * P if bf16 else 0.0  # autocast's cache of bf16 weight copies for the forward
        buckets = 4 * P if mode == "ddp" and world > 1 else 0.0  # the reducer's flat copy of every gradient
        at_loss = buckets + (grads if accum > 1 else 0.0)
        grads += buckets
    kd = teacher_bytes(teacher, tokens) if teacher is not None else {}
    return MemoryEstimate(
        mode=mode,
        weights=weights,
        gathered=gathered,
        gradients=grads,
        gradients_at_loss=at_loss,
        optimizer=optimizer,
        activations=acts["total"] * tokens + batch_bytes,
        loss_buffers=logits + kd.get("loss_buffers", 0),
        optimizer_temp=4 * params.decayed / shards,
        recompute=acts["recompute_layer"] * tokens,
        teacher_weights=kd.get("weights", 0),
        teacher_forward=kd.get("forward", 0),
        distill=kd.get("distill", 0),
    )


def estimate_run(cfg: TrainConfig, gpus: int, gpu_memory: float, dtype: str = "bfloat16",
                 tokens_per_gpu_s: float | None = None, peak_tflops: float | None = None, mfu: float = 0.4,
                 model: FusedKVConfig | None = None, teacher: Teacher | None = None) -> RunEstimate:
    """The memory and time estimate of `cfg` on `gpus` GPUs; `model` replaces the preset's model (uptraining: the
    source converted to the KV-sharing plan), `teacher` adds the teacher of a distillation run."""
    if gpus < 1:
        raise ValueError(f"--gpus {gpus}: must be a positive number of GPUs")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype {dtype!r}: choose float32 or bfloat16")
    if not 0 < mfu <= 1:
        raise ValueError(f"--mfu {mfu}: must be in (0, 1] (a fraction of the GPU's peak FLOP/s)")
    accum = cfg.grad_accum_steps(gpus)
    if model is not None:
        mc = FusedKVConfig.from_dict(model.to_dict())
        mc.max_position_embeddings = max(mc.max_position_embeddings, cfg.seq_len)
    else:
        mc = model_config(cfg)
    params = count_parameters(mc)
    plan = RunEstimate(cfg, mc, params, gpus, gpu_memory, dtype, cfg.micro_batch_size, accum, teacher=teacher)
    for mode in MODES:
        for ckpt in (False, True):
            plan.estimates[mode, ckpt] = estimate(
                mc, params, mode=mode, world=gpus, seq_len=cfg.seq_len, micro_batch=cfg.micro_batch_size,
                accum=accum, dtype=dtype, checkpointing=ckpt, teacher=teacher)
    plan.kv_bytes_per_token = mc.kv_cache_bytes_per_token(2)
    plan.kv_bytes_per_token_vanilla = mc.mha_kv_cache_bytes_per_token(2)  # MHA of the same shape
    plan.tokens = cfg.total_steps() * cfg.global_batch_tokens
    # PaLM (Chowdhery et al. 2022, App. B): 6N for the matmuls, 12 L H Q T for attention scores and values.
    attention = mc.num_hidden_layers * mc.num_attention_heads * mc.head_dim * cfg.seq_len
    plan.flops_per_token = 6 * params.active + 12 * attention
    if teacher is not None:  # its forward only: 2N + 4 L H Q T
        tc = teacher.config
        plan.flops_per_token += 2 * teacher.params.active + 4 * tc.num_hidden_layers * tc.num_attention_heads * (
            tc.head_dim * cfg.seq_len)
    if tokens_per_gpu_s is not None:
        if tokens_per_gpu_s <= 0:
            raise ValueError(f"--tokens-per-gpu-s {tokens_per_gpu_s}: must be positive")
        plan.tokens_per_gpu_s, plan.throughput_source = tokens_per_gpu_s, "given"
    elif peak_tflops is not None:
        if peak_tflops <= 0:
            raise ValueError(f"--peak-tflops {peak_tflops}: must be positive")
        plan.tokens_per_gpu_s = mfu * peak_tflops * 1e12 / plan.flops_per_token
        plan.throughput_source = f"assumed: {mfu:.0%} MFU of {peak_tflops:g} TFLOP/s"
    return plan


def _gb(x: float) -> str:
    if x < 1e9:
        return f"{x / 1e6:,.1f} MB"
    return f"{x / GB:,.2f} GB" if x < 100 * GB else f"{x / GB:,.0f} GB"


def _duration(seconds: float) -> str:
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def format_estimate(plan: RunEstimate) -> str:
    cfg, mc, p = plan.cfg, plan.mc, plan.params
    tok_step = cfg.micro_batch_size * cfg.seq_len
    t = plan.teacher
    what = f"preset {cfg.preset}" if t is None else f"uptraining, recipe {cfg.preset}"
    lines = [
        f"memory: {what}, plan {mc.kv_sharing}: {p.total / 1e6:,.1f}M parameters "
        f"({p.non_embedding / 1e6:,.1f}M without the embedding table), {mc.num_hidden_layers} layers, "
        f"hidden {mc.hidden_size}, vocab {mc.vocab_size:,}",
        f"  {plan.gpus} GPU(s) x {_gb(plan.gpu_memory)}; sequence {cfg.seq_len}, micro-batch {cfg.micro_batch_size} "
        f"({tok_step:,} tokens), {plan.accum} micro-batch(es) per GPU per step, global batch "
        f"{cfg.global_batch_tokens:,} tokens; {'bf16 autocast' if plan.dtype == 'bfloat16' else 'fp32'}",
    ]
    if t is not None:
        lines.append(f"  teacher {t.name}: {t.params.total / 1e6:,.1f}M parameters "
                     f"({t.params.active / 1e6:,.1f}M active per token) in {8 * t.dtype_bytes}-bit on every GPU, "
                     "forward only"
                     + (", hidden states kept" if t.hidden else ""))
    lines.append("")
    keys = [(m, c) for c in (False, True) for m in MODES if (m, c) in plan.estimates]
    names = [f"{'DDP' if m == 'ddp' else 'FSDP (full shard)'}{' + act. ckpt' if c else ''}" for m, c in keys]
    lines += ["| per GPU | " + " | ".join(names) + " |", "|---" * (len(keys) + 1) + "|"]
    cols = [plan.estimates[k] for k in keys]
    rows = [
        ("weights (fp32)", "weights"),
        ("unsharded params / bf16 weight cache", "gathered"),
        ("gradients (at the optimizer step)", "gradients"),
        ("gradients (at the last loss backward)", "gradients_at_loss"),
        ("AdamW moments", "optimizer"),
        ("activations (one micro-batch)", "activations"),
        ("loss backward buffers (T x V)", "loss_buffers"),
        ("optimizer-step temporary", "optimizer_temp"),
        ("one layer recomputed", "recompute"),
        *([("teacher weights (every GPU)", "teacher_weights"), ("teacher forward (no grad)", "teacher_forward"),
           ("distillation log-probs (saved)", "distill")] if t is not None else []),
        ("**peak**", "peak"),
    ]
    for label, attr in rows:
        lines.append(f"| {label} | " + " | ".join(_gb(getattr(e, attr)) for e in cols) + " |")
    lines.append("| fits? | " + " | ".join(
        ("yes" if e.peak <= plan.gpu_memory else "**no**") + f" ({e.peak / plan.gpu_memory:.0%})" for e in cols
    ) + " |")
    kv_seq = plan.kv_bytes_per_token * mc.max_position_embeddings
    weights_bf16 = 2 * p.total
    free = plan.gpu_memory - weights_bf16
    fit_seqs = max(0, int(free // kv_seq)) if kv_seq else 0
    lines += [
        "",
        f"inference KV cache (bf16): {plan.kv_bytes_per_token:,} bytes/token "
        f"({plan.kv_bytes_per_token / plan.kv_bytes_per_token_vanilla:.2f} x MHA's "
        f"{plan.kv_bytes_per_token_vanilla:,}); {_gb(kv_seq)} per {mc.max_position_embeddings}-token sequence; "
        f"next to the bf16 weights ({_gb(weights_bf16)}) one GPU holds {fit_seqs:,} such sequences",
        f"token budget: {plan.tokens:,} tokens ({cfg.total_steps():,} steps); "
        f"{plan.flops_per_token / 1e9:,.2f} GFLOP per token (6N + 12 L H Q T"
        + (", + the teacher's forward 2N + 4 L H Q T)" if t is not None else ")"),
    ]
    if plan.tokens_per_gpu_s:
        total = plan.tokens_per_gpu_s * plan.gpus
        lines.append(
            f"time: {plan.tokens_per_gpu_s:,.0f} tokens/s per GPU ({plan.throughput_source}) x {plan.gpus} = "
            f"{total:,.0f} tokens/s -> {_duration(plan.tokens / total)} for the budget "
            f"({_duration(cfg.global_batch_tokens / total)} per step)"
        )
    else:
        lines.append("time: give --tokens-per-gpu-s (measured, e.g. a run's summary.json tokens_per_s / GPUs) "
                     "or --peak-tflops [--mfu] for the training time")
    best = min(cols, key=lambda e: e.peak)
    if best.peak > plan.gpu_memory:
        lines.append("verdict: does not fit in any layout shown: lower --micro-batch or --seq-len, add GPUs "
                     "(FSDP), or turn on activation checkpointing")
    else:
        fits = [name for name, e in zip(names, cols) if e.peak <= plan.gpu_memory]
        lines.append(f"verdict: fits with {', '.join(fits)}")
    return "\n".join(lines)
