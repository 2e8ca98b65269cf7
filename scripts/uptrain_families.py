"""Per-family uptraining results: tiny pretrained Qwen3, Llama and DeepSeek-V3 teachers, each uptrained to
FusedKV (and Lite, where it applies) at several seeds, against a control run (docs/results.md, docs/uptraining.md).

    nice -n 10 env OMP_NUM_THREADS=1 .venv/bin/python scripts/uptrain_families.py runs/uptrain-families

For each family:
  1. a teacher: transformers' own class (Qwen3ForCausalLM, LlamaForCausalLM, DeepseekV3ForCausalLM) at tiny
     dims, pre-trained `--teacher-steps` steps on the built-in corpus with a plain AdamW loop, so that it is
     not random. The Llama and DeepSeek configs pad vocab_size past the tokenizer (as the published ones do);
     the DeepSeek one has an odd layer count (5: the lower 3 layers keep their latent cache).
  2. per plan and seed: `fusedkv uptrain TEACHER OUT --plan P --seed S ...` (run in this process through the
     command's own parser, so the recorded command is the one a user types).
  3. per seed, the control: the teacher imported as vanilla fusedkv and trained with the very same recipe
     (distillation from the teacher, same steps, data order and held-out windows). The uptrained model is
     judged against it: `recovered share vs control = (before - after) / (before - control)`, 100% meaning
     the half-size cache costs nothing against a teacher that got the same extra training.

Everything is cached under OUT by a hash of its settings (teachers/FAMILY-HASH, runs/FAMILY/RUN-HASH): a
re-run reuses what finished, resumes an interrupted uptraining or control run from its checkpoint, and
trains anything whose settings changed afresh. The table goes to OUT/results.md, the numbers to
OUT/results.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

FAMILY_PLANS = {  # Lite reuses K and V from different layers, which MLA cannot (one latent holds both)
    "qwen3": ("fusedkv", "fusedkv-lite"),
    "llama": ("fusedkv", "fusedkv-lite"),
    "deepseek_v3": ("fusedkv",),
}
TOKENIZER_VOCAB = 1024
PADDED_VOCAB = 1088  # Llama / DeepSeek: vocab_size rounded up past the tokenizer, as published checkpoints do


def teacher_config(family: str, eos: int, pad: int):
    """A tiny config of the family (hidden 64, 4 heads of 16, context 128)."""
    from transformers import DeepseekV3Config, LlamaConfig, Qwen3Config

    common = dict(hidden_size=64, num_attention_heads=4, intermediate_size=192, max_position_embeddings=128,
                  bos_token_id=eos, eos_token_id=eos, pad_token_id=pad)
    if family == "qwen3":
        return Qwen3Config(**common, vocab_size=TOKENIZER_VOCAB, num_hidden_layers=4, num_key_value_heads=4,
                           head_dim=16)
    if family == "llama":
        return LlamaConfig(**common, vocab_size=PADDED_VOCAB, num_hidden_layers=4, num_key_value_heads=2)
    return DeepseekV3Config(**common, vocab_size=PADDED_VOCAB, num_hidden_layers=5, num_key_value_heads=4,
                            moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                            first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=None,
                            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def _key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:10]


def pretrain_teacher(family: str, ds, root: Path, steps: int, say) -> Path:
    """The family's transformers model trained `steps` steps of 16 x 64 tokens (AdamW, lr 3e-3, 20 warm-up
    steps, cosine to 10%); written atomically with the data's tokenizer. Cached by its settings."""
    from transformers import AutoModelForCausalLM

    config = teacher_config(family, ds.eos_id, ds.meta.get("pad_id") or 0)
    settings = {"config": config.to_dict(), "steps": steps, "data": ds.meta["request"], "recipe": "v1"}
    out = root / "teachers" / f"{family}-{_key(settings)}"
    if (out / "config.json").is_file():
        return out
    say(f"teacher {family}: pre-training {steps} steps -> {out}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    tokens = torch.from_numpy(ds.train.tokens.astype("int64"))
    g = torch.Generator().manual_seed(0)
    batch, seq = 16, 64
    t0 = time.time()
    for step in range(steps):
        lr = 3e-3 * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=g)
        ids = torch.stack([tokens[s:s + seq] for s in starts.tolist()])
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            say(f"  step {step + 1}/{steps} loss {loss.item():.3f} ({time.time() - t0:.0f}s)")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.eval().save_pretrained(tmp)
    shutil.copytree(ds.tokenizer_dir, tmp, dirs_exist_ok=True)
    (tmp / "pretrain.json").write_text(json.dumps({**settings, "final_train_loss": loss.item(),
                                                   "wall_s": time.time() - t0}, indent=1, default=str))
    os.replace(tmp, out)
    return out


def uptrain_args(teacher: Path, out: Path, plan: str, seed: int, data: Path, steps: int) -> list[str]:
    """The `fusedkv uptrain` command line of one run: nano's 8 x 64-token batch without accumulation."""
    return ["uptrain", str(teacher), str(out), "--plan", plan, "--seed", str(seed), "--data", str(data),
            "--preset", "nano", "--max-steps", str(steps), "--set", "micro_batch_size=8", "--set", "warmup_steps=5",
            "--set", "eval_every=10", "--set", "ckpt_every=10", "--set", "final_eval_batches=16",
            "--set", "threads=1", "--quiet"]


def run_uptrain(args: list[str]) -> dict:
    from fusedkv.cli import build_parser
    from fusedkv.uptrain.command import build
    from fusedkv.uptrain.pipeline import run_uptrain as run

    parsed = build_parser().parse_args(args)
    out = Path(parsed.out)
    if (out / "report.json").is_file():
        report = json.loads((out / "report.json").read_text())
        if report["train"]["steps"] == parsed.max_steps:
            return report
    return run(build(parsed, "fusedkv " + " ".join(args)), progress=False)


def run_control(args: list[str], out: Path) -> dict:
    """The teacher, imported as vanilla fusedkv, trained with the uptraining run's own recipe (`args` with
    another OUT): distillation from itself plus the LM loss, the same steps, seed and held-out windows."""
    from fusedkv.cli import build_parser
    from fusedkv.convert import convert_checkpoint
    from fusedkv.train import full_checkpoint as ckpt_io
    from fusedkv.train import train
    from fusedkv.uptrain.command import build

    parsed = build_parser().parse_args(args)
    vanilla = out / "vanilla"
    if not (vanilla / "config.json").is_file():
        convert_checkpoint(Path(parsed.src), vanilla, kv_sharing="vanilla", overwrite=True)
    cfg = build(parsed).cfg.replace(init_from=str(vanilla), out_dir=str(out / "train"))
    summary_file = out / "train" / "summary.json"
    if summary_file.is_file():
        summary = json.loads(summary_file.read_text())
        if summary.get("steps") == cfg.total_steps() and not summary.get("stopped"):
            return summary
    resume = bool(ckpt_io.list_checkpoints(ckpt_io.checkpoint_root(out / "train")))
    summary = train(cfg.replace(resume=True) if resume else cfg.replace(overwrite=True))
    if summary.get("stopped"):
        raise SystemExit(f"control {out} stopped by {summary['stopped']}; re-run to resume it")
    return summary


def _mean_sd(xs: list[float], fmt: str) -> str:
    xs = [x for x in xs if x is not None]
    if len(xs) < 2:
        return format(xs[0], fmt) if xs else "-"
    return f"{format(statistics.mean(xs), fmt)} ± {format(statistics.stdev(xs), fmt.lstrip('+'))}"


def table(rows: list[dict]) -> str:
    head = ("| family | plan | seed | teacher | converted, before | after uptraining | control (teacher + same "
            "steps) | recovered share (vs teacher) | recovered share vs control | after − control | KV cache "
            "bytes/token (student / teacher) |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    pcts = lambda xs: [None if x is None else 100 * x for x in xs]  # noqa: E731
    for family in dict.fromkeys(r["family"] for r in rows):
        for plan in dict.fromkeys(r["plan"] for r in rows if r["family"] == family):
            group = [r for r in rows if r["family"] == family and r["plan"] == plan]
            for r in group:
                lines.append(f"| {family} | {plan} | {r['seed']} | {r['teacher']:.4f} | {r['before']:.4f} | "
                             f"{r['after']:.4f} | {r['control']:.4f} | {pct(r['share'])} | "
                             f"{pct(r['share_vs_control'])} | {r['after'] - r['control']:+.4f} | "
                             f"{r['cache_student']:,} / {r['cache_teacher']:,} |")
            lines.append(
                f"| **{family}** | **{plan}** | mean ± sd ({len(group)}) | {group[0]['teacher']:.4f} | "
                f"{_mean_sd([r['before'] for r in group], '.4f')} | {_mean_sd([r['after'] for r in group], '.4f')} | "
                f"{_mean_sd([r['control'] for r in group], '.4f')} | "
                f"{_mean_sd(pcts([r['share'] for r in group]), '.1f')}% | "
                f"{_mean_sd(pcts([r['share_vs_control'] for r in group]), '.1f')}% | "
                f"{_mean_sd([r['after'] - r['control'] for r in group], '+.4f')} | |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="output and cache directory (e.g. runs/uptrain-families)")
    ap.add_argument("--families", nargs="+", default=list(FAMILY_PLANS), choices=list(FAMILY_PLANS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--teacher-steps", type=int, default=400, help="teacher pre-training steps (default 400)")
    ap.add_argument("--steps", type=int, default=40, help="uptraining (and control) steps (default 40)")
    ap.add_argument("--data", default="builtin",
                    help="the text everything trains and is scored on, as `fusedkv train --data` takes it "
                         "(default: the built-in corpus; a small text file makes a quick check)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from fusedkv.data import prepare_dataset

    def say(msg):
        print(msg, flush=True)

    root = args.out
    root.mkdir(parents=True, exist_ok=True)
    data = root / "data" / (f"builtin-bpe{TOKENIZER_VOCAB}" if args.data == "builtin"
                            else f"{_key(str(Path(args.data).resolve()))}-bpe{TOKENIZER_VOCAB}")
    ds = prepare_dataset(args.data, data, vocab_size=TOKENIZER_VOCAB, num_proc=1)
    rows = []
    for family in args.families:
        teacher = pretrain_teacher(family, ds, root, args.teacher_steps, say)
        for seed in args.seeds:
            recipe = uptrain_args(teacher, root, "vanilla", seed, data, args.steps)[3:]
            control_dir = root / "runs" / family / f"control-s{seed}-{_key([teacher.name, recipe])}"
            t0 = time.time()
            control = run_control(uptrain_args(teacher, control_dir, "fusedkv", seed, data, args.steps), control_dir)
            say(f"{family} control seed {seed}: {control['init_val_loss']:.4f} -> {control['val_loss']:.4f} "
                f"({time.time() - t0:.0f}s)")
            for plan in FAMILY_PLANS[family]:
                tail = uptrain_args(teacher, root, plan, seed, data, args.steps)[3:]
                out = root / "runs" / family / f"{plan}-s{seed}-{_key([teacher.name, tail])}"
                t0 = time.time()
                report = run_uptrain(uptrain_args(teacher, out, plan, seed, data, args.steps))
                m = report["models"]
                teacher_loss, before, after = (m[w]["val_loss"] for w in ("teacher", "before", "after"))
                rows.append(dict(
                    family=family, plan=plan, seed=seed, teacher=teacher_loss, before=before, after=after,
                    control=control["val_loss"], control_start=control["init_val_loss"],
                    share=report["recovered_share"],
                    share_vs_control=(before - after) / (before - control["val_loss"])
                    if before > control["val_loss"] else None,
                    cache_student=report["kv_cache_bytes_per_token"]["student"],
                    cache_teacher=report["kv_cache_bytes_per_token"]["teacher"],
                    out=str(out), command=report["command"], wall_s=report["train"].get("wall_time_s")))
                say(f"{family} {plan} seed {seed}: teacher {teacher_loss:.4f} before {before:.4f} after {after:.4f} "
                    f"control {control['val_loss']:.4f} ({time.time() - t0:.0f}s)")
    (root / "results.json").write_text(json.dumps(rows, indent=1))
    text = table(rows)
    (root / "results.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    sys.exit(main())
