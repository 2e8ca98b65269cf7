"""Inference benchmark: cache bytes, TTFT, TPOT and decode throughput of every plan, and of
transformers' own `Qwen3ForCausalLM` on the same vanilla weights.

Everything is measured interleaved in one process (round-robin over plans inside each repeat, the
order rotated from repeat to repeat), and each figure is a median, so ratios to vanilla stay fair
on a noisy shared machine. The FusedKV TPOT target is judged against its byte floor: (weights + KV
bytes FusedKV reads per step) / (weights + KV bytes vanilla reads per step), computed from the plan.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessor, LogitsProcessorList, Qwen3Config, Qwen3ForCausalLM

from ..cache import StaticKVCache
from ..config import FusedKVConfig
from ..convert import from_qwen3_state, qwen3_to_fusedkv_config
from ..engine.precision import SHORT_NAMES, head_format, kv_dtype_for, reduce_precision, weight_format
from ..generation import generate
from ..model import FusedKVForCausalLM
from ..plan import FULL, SLIDING, VANILLA, resolve_plan_choice
from ..quant import kivi_cache_factory
from ..utils import save_figure

HF = "hf-qwen3"  # transformers' Qwen3ForCausalLM.generate on the vanilla weights


@dataclass
class BenchShape:
    num_hidden_layers: int = 8
    hidden_size: int = 512
    intermediate_size: int = 1536
    num_attention_heads: int = 8
    head_dim: int = 64
    vocab_size: int = 8192
    # Sliding-window hybrid (paper App. A.6): in each group of `window_group` layers all but the last
    # attend over a window of `sliding_window` tokens. None: every layer is full attention.
    sliding_window: int | None = None
    window_group: int = 4
    # Other architectures (paper App. A.6), as FusedKVConfig fields given to every plan: MoE
    # (num_experts, num_experts_per_tok, moe_intermediate_size) or MLA (kv_lora_rank, qk_*_head_dim, ...).
    # Set: every plan gets fresh weights and there is no transformers Qwen3 row (it is another model).
    architecture: dict = field(default_factory=dict)

    def layer_types(self) -> list[str] | None:
        if not self.sliding_window:
            return None
        return [FULL if (i + 1) % self.window_group == 0 else SLIDING for i in range(self.num_hidden_layers)]

    def model_fields(self) -> dict:
        """The fields a FusedKVConfig takes."""
        fields = {k: v for k, v in vars(self).items() if k not in ("sliding_window", "window_group", "architecture")}
        fields.update(self.architecture)
        if self.sliding_window:
            fields.update(layer_types=self.layer_types(), sliding_window=self.sliding_window)
        return fields


class _StepTimer(LogitsProcessor):
    """Timestamps every call transformers' generate makes to its logits processors: once per token."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


def shape_config(shape: BenchShape, plans: list[str], max_len: int = 4096) -> list[FusedKVConfig]:
    """The config of every plan's model when it is built from scratch: validates the combination of
    shape and plans up front (FusedKVConfig raises ValueError with the reason)."""
    configs = []
    for label in plans:
        configs.append(FusedKVConfig(**shape.model_fields(), max_position_embeddings=max_len,
                                     **resolve_plan_choice(label).config_kwargs(shape.num_attention_heads)))
    return configs


def build_models(shape: BenchShape, plans: list[str], max_len: int, device: str, dtype: torch.dtype,
                 include_hf: bool = True) -> dict[str, torch.nn.Module]:
    """One model per plan; vanilla is converted from a random Qwen3 so the HF comparison uses the
    very same weights."""
    torch.manual_seed(0)
    qcfg = Qwen3Config(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                       intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_hidden_layers,
                       num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_attention_heads,
                       head_dim=shape.head_dim, max_position_embeddings=max_len, tie_word_embeddings=False,
                       **({} if not shape.sliding_window else dict(
                           layer_types=shape.layer_types(), sliding_window=shape.sliding_window,
                           use_sliding_window=True, max_window_layers=0)))
    hf = Qwen3ForCausalLM(qcfg).eval()
    qwen3 = {**qcfg.to_dict(), "use_sliding_window": False}  # the window comes in through `window` below
    window = {} if not shape.sliding_window else dict(layer_types=shape.layer_types(),
                                                      sliding_window=shape.sliding_window)
    models: dict[str, torch.nn.Module] = {}
    for label in plans:
        plan = resolve_plan_choice(label).config_kwargs(shape.num_attention_heads)
        # The same weights for every plan whose shapes allow it (upper layers drop K/V projections);
        # fewer KV heads means other K/V shapes and fresh weights (speed does not depend on their values).
        if plan.pop("num_key_value_heads") == shape.num_attention_heads and not shape.architecture:
            cfg = qwen3_to_fusedkv_config(qwen3, **plan, **window)
            model = from_qwen3_state(hf.state_dict(), cfg)
        else:
            model = FusedKVForCausalLM(shape_config(shape, [label], max_len)[0])
        models[label] = model.to(device, dtype).eval()
    if include_hf and not shape.architecture:
        models[HF] = hf.to(device, dtype)
    return models


def _measure(model, name: str, ids: torch.Tensor, new_tokens: int, cache_factory=None) -> dict:
    if name == HF:
        timer = _StepTimer()
        with torch.inference_mode():
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           logits_processor=LogitsProcessorList([timer]), pad_token_id=0)
        stamps = [start, *timer.stamps]
        steps = [b - a for a, b in zip(stamps[1:], stamps[2:])]
        return dict(ttft=stamps[1] - start, tpot=statistics.median(steps), cache_bytes=None)
    r = generate(model, ids, new_tokens, weight_layout="auto", cache_factory=cache_factory)
    return dict(ttft=r.ttft_s, tpot=r.tpot_s, cache_bytes=r.cache_bytes)


def precision_row(model, label: str, spec: str):
    """(row name, reduced copy of `model`, cache factory) for a "WEIGHTS/KV" spec ("int8/half"); WEIGHTS may
    name the LM head's format after an @ ("int4@int4/half": the head at int4 too, not int8)."""
    import copy

    weights, _, kv = spec.partition("/")
    weights, _, head = weights.partition("@")
    fmt, kv_dtype = weight_format(weights), kv_dtype_for(kv or weights)
    head = head_format(fmt, head or None)
    reduced = model if fmt == head == "float32" else reduce_precision(copy.deepcopy(model), fmt, head)

    def factory(config, batch, max_len, dtype, device):
        return StaticKVCache(config, batch, max_len, kv_dtype, device)

    factory.kv_element_size = torch.finfo(kv_dtype).bits // 8
    w = SHORT_NAMES[fmt] + ("" if head == head_format(fmt) else f"@{SHORT_NAMES[head]}")
    return f"{label} w={w} kv={SHORT_NAMES[str(kv_dtype).removeprefix('torch.')]}", reduced, factory


def byte_floor(model: FusedKVForCausalLM, vanilla: FusedKVForCausalLM, context: int, batch: int,
               kv_element_size: int | None = None) -> float:
    """(weights + KV read per decode step) of `model` over the same for vanilla. Reduced-precision
    weights are buffers (`fusedkv.engine.precision`), so buffers count; `kv_element_size` is the
    model's cache width when it differs from its parameters' (a 16-bit cache)."""
    def per_step(m, kv_size=None):
        c = m.config
        weights = sum(t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers()))
        # Each layer reads every source once, over the context (a window layer: over its window); an MLA
        # source is one latent and RoPE key that gives both K and V.
        if c.kv_lora_rank is not None:
            tokens = sum(len(set(layer.k_sources) | set(layer.v_sources)) * context for layer in c.plan.layers)
            kv = tokens * (c.kv_lora_rank + c.qk_rope_head_dim) * batch
        else:
            tokens = sum((len(layer.k_sources) + len(layer.v_sources))
                         * (min(context, c.sliding_window) if layer.attention_type == SLIDING else context)
                         for layer in c.plan.layers)
            kv = tokens * c.num_key_value_heads * c.head_dim * batch
        return weights + kv * (kv_size or next(m.parameters()).element_size())
    return per_step(model, kv_element_size) / per_step(vanilla)


def run_inference_bench(shape: BenchShape, plans: list[str], prompt_lens: list[int], batch_sizes: list[int],
                        new_tokens: int = 16, repeats: int = 3, include_hf: bool = True, device: str = "cpu",
                        dtype: torch.dtype = torch.float32, progress=None, kv_bits: tuple[int, ...] = (),
                        kv_group: int = 32, kv_residual: int = 128, precisions: tuple[str, ...] = ()) -> list[dict]:
    """`kv_bits` adds a row "<plan>+kivi<b>" per plan: the same model decoding through the KIVI b-bit
    cache (`fusedkv.quant`), for its TPOT and bytes against the full-precision cache. `precisions`
    ("WEIGHTS/KV", e.g. "int8/half") adds a row "<plan> w=WEIGHTS kv=KV" per plan: reduced-precision
    weights and a KV cache of that width (`fusedkv.engine.precision`, CPU)."""
    if VANILLA not in plans:
        plans = [VANILLA, *plans]
    max_len = max(prompt_lens) + new_tokens + 8
    models = build_models(shape, plans, max_len, device, dtype, include_hf)
    factories = {}
    for label in [n for n in models if n != HF]:
        for bits in kv_bits:
            models[f"{label}+kivi{bits}"] = models[label]
            factories[f"{label}+kivi{bits}"] = kivi_cache_factory(bits, kv_group, kv_residual)
        for spec in precisions:
            name, models[name], factories[name] = precision_row(models[label], label, spec)
    names = list(models)
    samples: dict[tuple, list[dict]] = {}
    gen = torch.Generator().manual_seed(0)
    warm_len = min(32, max_len - 4)  # within the models' context, also for short --prompt-lens
    for name in names:  # warm-up: first calls allocate and tune
        _measure(models[name], name, torch.randint(1, shape.vocab_size, (1, warm_len), generator=gen).to(device), 4,
                 factories.get(name))
    jobs = [(r, b, s) for r in range(repeats) for b in batch_sizes for s in prompt_lens]
    for r, b, s in jobs:
        ids = torch.randint(1, shape.vocab_size, (b, s), generator=gen).to(device)
        # Interleaved: every plan sees the same machine state within a repeat; the order rotates
        # each repeat so that no plan always runs first after a change of shape (allocator, layout).
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            samples.setdefault((name, b, s), []).append(_measure(models[name], name, ids, new_tokens,
                                                                 factories.get(name)))
            if progress:
                progress(f"repeat {r + 1}/{repeats} batch {b} prompt {s} {name}")
    rows = []
    for (name, b, s), runs in samples.items():
        ttft = statistics.median(x["ttft"] for x in runs)
        tpot = statistics.median(x["tpot"] for x in runs)
        rows.append(dict(plan=name, batch=b, prompt=s, ttft_s=ttft, tpot_s=tpot, decode_tok_s=b / tpot,
                         cache_bytes=runs[0]["cache_bytes"]))
    by_key = {(r["plan"], r["batch"], r["prompt"]): r for r in rows}
    for r in rows:
        base = by_key[(VANILLA, r["batch"], r["prompt"])]
        r["ttft_ratio"] = r["ttft_s"] / base["ttft_s"]
        r["tpot_ratio"] = r["tpot_s"] / base["tpot_s"]
        r["cache_ratio"] = None
        if r["plan"] != HF:
            context = r["prompt"] + new_tokens
            # Measured bytes over MHA of the same shape (`FusedKVConfig.mha_kv_cache_bytes_per_token`),
            # the one baseline of every cache ratio; the static cache holds prompt + new tokens.
            model = models[r["plan"]]
            mha = model.config.mha_kv_cache_bytes_per_token(next(model.parameters()).element_size())
            r["cache_ratio"] = r["cache_bytes"] / (mha * r["batch"] * context)
            kv_size = getattr(factories.get(r["plan"]), "kv_element_size", None)
            r["tpot_byte_floor"] = byte_floor(model, models[VANILLA], context, r["batch"], kv_size)
            bytes_per_token = r["cache_bytes"] / (r["batch"] * (r["prompt"] + new_tokens))
            r["cache_bytes_per_token"] = bytes_per_token
    for r in rows:  # longest context inside a fixed cache budget, relative to vanilla
        if r["plan"] != HF:
            r["context_at_budget_ratio"] = (by_key[(VANILLA, r["batch"], r["prompt"])]["cache_bytes_per_token"]
                                            / r["cache_bytes_per_token"])
    return rows


def format_table(rows: list[dict]) -> str:
    head = ("| plan | batch | prompt | cache bytes | cache vs MHA | context at fixed budget | TTFT ms | "
            "TTFT vs vanilla | TPOT ms | TPOT vs vanilla | TPOT byte floor | decode tok/s |")
    lines = [head, "|---" * 12 + "|"]
    for r in sorted(rows, key=lambda r: (r["batch"], r["prompt"])):
        cache = f"{r['cache_bytes']:,}" if r["cache_bytes"] is not None else "n/a"
        cratio = f"{r['cache_ratio']:.2f}" if r["cache_ratio"] is not None else "n/a"
        budget = f"{r['context_at_budget_ratio']:.2f}x" if "context_at_budget_ratio" in r else "n/a"
        floor = f"{r['tpot_byte_floor']:.2f}" if "tpot_byte_floor" in r else "n/a"
        lines.append(
            f"| {r['plan']} | {r['batch']} | {r['prompt']} | {cache} | {cratio} | {budget} | {r['ttft_s'] * 1e3:.1f} | "
            f"{r['ttft_ratio']:.2f} | {r['tpot_s'] * 1e3:.2f} | {r['tpot_ratio']:.2f} | {floor} | "
            f"{r['decode_tok_s']:.1f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """TTFT and TPOT against prompt length, one line per plan (the paper's Fig. 4/5), batch 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch = min(r["batch"] for r in rows)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "ttft_ratio", "TTFT / vanilla"), (axes[1], "tpot_ratio", "TPOT / vanilla")):
        for plan in dict.fromkeys(r["plan"] for r in rows):
            pts = sorted((r["prompt"], r[key]) for r in rows if r["plan"] == plan and r["batch"] == batch)
            ax.plot([p for p, _ in pts], [v for _, v in pts], marker="o", label=plan)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length (tokens)")
        ax.set_title(f"{title} (batch {batch}, lower is better)")
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
