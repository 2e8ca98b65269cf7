"""The paper's compatibility table (App. A.6) at small scale: full precision, KIVI-4, KIVI-2 and Wanda
50% (unstructured and 2:4) for trained checkpoints, with held-out loss/perplexity, accuracy on the
shipped offline lm-eval tasks and KV-cache bytes per token relative to an fp16 vanilla cache. Several
checkpoints of one plan (seeds) are summarised as mean +- std.

    fusedkv compare quant          # the main table's vanilla and FusedKV runs, 3 seeds
    .venv/bin/python benchmarks/kivi_wanda_table.py --compare runs/compare-quant \\
        --val runs/data/builtin-v4096 --windows 64 --group 32 --residual 32 --json docs/kivi_wanda_main.json

A training step directory (`runs/X/checkpoints/step-N`) is exported to a plain checkpoint first
(`--tokenizer` names the tokenizer directory to copy beside it). Loss under KIVI is scored token by
token through the cache (`fusedkv.quant.scoring`); Wanda models are scored by one full forward (the
weights change, not the cache). The same numbers come from the CLI:
`fusedkv eval CK --kv-bits 4 --kv-group 32 --kv-residual 32 --tasks none` and
`fusedkv prune CK --sparsity 0.5 --out DIR` then `fusedkv eval DIR --tasks none`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer, DynamicCache

from fusedkv.cache import kv_cache_nbytes
from fusedkv.config import FusedKVConfig
from fusedkv.data import TokenShard, iter_eval_batches, load_prepared_dataset
from fusedkv.eval.perplexity import validation_loss
from fusedkv.model import FusedKVForCausalLM
from fusedkv.prune.wanda import builtin_calibration_tokens, calibration_batches, wanda_prune
from fusedkv.quant import KIVICache, kivi_bytes_per_token
from fusedkv.quant.scoring import DecodeScorer


def load(path: str, tokenizer: str | None, tmp: Path) -> Path:
    """A plain checkpoint directory for `path` (exporting a training step directory if needed)."""
    p = Path(path)
    if (p / "config.json").exists():
        return p
    from safetensors.torch import load_file

    cfg = FusedKVConfig(**json.loads((p / "model_config.json").read_text()))
    model = FusedKVForCausalLM(cfg)
    model.load_state_dict(load_file(str(p / "model.safetensors")))
    out = tmp / p.parent.parent.name
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(out)
    return out


def fp16_vanilla_bytes_per_token(cfg) -> int:
    """The reference: every layer stores K and V for every KV head in fp16."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2


def kivi_ratio(cfg, bits: int, group: int) -> float:
    """Asymptotic KIVI cache bytes per token of this model's plan over fp16 vanilla (scales included)."""
    per_layer = cfg.num_key_value_heads * kivi_bytes_per_token(cfg.head_dim, bits, group)
    return len(cfg.plan.storage_layers) * per_layer / fp16_vanilla_bytes_per_token(cfg)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="*")
    p.add_argument("--compare", default=None, help="a `fusedkv compare` output directory: its finished runs")
    p.add_argument("--val", required=True)
    p.add_argument("--tokenizer", default=None, help="tokenizer dir for exporting training step directories")
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--residual", type=int, default=32)
    p.add_argument("--calib-seqs", type=int, default=64)
    p.add_argument("--tasks", type=int, default=40, help="items per offline lm-eval task (0: skip tasks)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.compare:
        done = sorted(Path(args.compare).glob("*/seed*/result.json"))
        args.checkpoints += [json.loads(r.read_text())["checkpoint"] for r in done]
    if not args.checkpoints:
        p.error("give checkpoints or --compare results.json")
    val = Path(args.val)
    shard = load_prepared_dataset(val).val if val.is_dir() else TokenShard(val)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ck in args.checkpoints:
            path = load(ck, args.tokenizer, Path(tmp))
            model = FusedKVForCausalLM.from_pretrained(path).eval()
            cfg = model.config
            seq = cfg.max_position_embeddings
            batches = list(iter_eval_batches(shard, seq, batch_size=args.windows, max_batches=1))
            plan_cache = len(cfg.plan.storage_layers) / cfg.num_hidden_layers

            tok = AutoTokenizer.from_pretrained(path)

            def row(method, loss, ratio, measured=None, tasks=None, ck=ck, plan=cfg.kv_sharing):
                rows.append(dict(checkpoint=ck, plan=plan, method=method, loss=loss, ppl=math.exp(loss),
                                 cache_vs_fp16_vanilla=ratio, measured_vs_fp32_vanilla=measured, tasks=tasks))
                extra = f" measured/fp32-vanilla {measured:.4f}" if measured else ""
                extra += f" task avg {100 * statistics.mean(tasks.values()):.1f}" if tasks else ""
                print(f"{plan:>8} {method:<22} loss {loss:.4f} ppl {math.exp(loss):8.2f} "
                      f"cache/fp16-vanilla {ratio:.4f}{extra}", flush=True)

            with torch.no_grad():
                full = validation_loss(model, batches, shifted=True)
                vanilla_fp32 = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * (seq - 1)
                fp_tasks = task_scores(model, tok, args.tasks)
                row("full precision", full, plan_cache, tasks=fp_tasks)
                for bits, group in ((4, args.group), (2, args.group)):
                    scorer = DecodeScorer(model, lambda c, b=bits, g=group: KIVICache(c, b, g, args.residual))
                    loss = validation_loss(scorer, batches, shifted=True)
                    one = scorer(batches[0][0][:1, :-1]).cache
                    # No task column: lm-eval scores each choice with one forward, which attends over its
                    # own K/V in full precision (KIVI Algorithm 1 quantises only what later steps read),
                    # so the accuracy under KIVI is the full-precision one by construction.
                    row(f"KIVI-{bits} (G={group},R={args.residual})", loss, kivi_ratio(cfg, bits, group),
                        kv_cache_nbytes(one) / vanilla_fp32)
                fp_cache = DecodeScorer(model, lambda c: DynamicCache(config=c))(batches[0][0][:1, :-1]).cache
                assert kv_cache_nbytes(fp_cache) == plan_cache * vanilla_fp32  # the plan's promise, measured
                calib = calibration_batches(builtin_calibration_tokens(tok, args.calib_seqs * seq), args.calib_seqs,
                                            seq)
                for name, kw in (("Wanda 50%", dict(sparsity=0.5)), ("Wanda 2:4", dict(sparsity=None, nm=(2, 4)))):
                    pruned = FusedKVForCausalLM.from_pretrained(path).eval()
                    wanda_prune(pruned, calib, **kw)
                    row(name, validation_loss(pruned, batches, shifted=True), plan_cache,
                        tasks=task_scores(pruned, tok, args.tasks))
    print()
    print(summary(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def task_scores(model, tokenizer, limit: int) -> dict[str, float] | None:
    """Accuracy on the shipped offline lm-eval tasks (zero-shot), as `fusedkv compare` reports it."""
    if not limit:
        return None
    from fusedkv.eval.harness import LOCAL_TASKS, run_lm_eval

    results = run_lm_eval(model, tokenizer, tasks=list(LOCAL_TASKS), limit=limit, num_fewshot=0)["results"]
    return {task: results[task]["acc"] for task in LOCAL_TASKS}


def _mean_std(xs: list[float], fmt: str) -> str:
    if len(xs) == 1:
        return format(xs[0], fmt)
    return f"{format(statistics.mean(xs), fmt)} ± {format(statistics.stdev(xs), fmt)}"


def summary(rows: list[dict]) -> str:
    """One line per (plan, method): mean +- std over the checkpoints (seeds) of that plan."""
    lines = ["| plan | method | seeds | valid loss | perplexity | task avg (%) | cache vs fp16 vanilla |",
             "|---|---|---|---|---|---|---|"]
    for key in dict.fromkeys((r["plan"], r["method"]) for r in rows):
        rs = [r for r in rows if (r["plan"], r["method"]) == key]
        tasks = [100 * statistics.mean(r["tasks"].values()) for r in rs if r["tasks"]]
        task_cell = _mean_std(tasks, ".1f") if tasks else "= FP (one forward)" if "KIVI" in key[1] else "-"
        lines.append(f"| {key[0]} | {key[1]} | {len(rs)} | {_mean_std([r['loss'] for r in rs], '.4f')} | "
                     f"{_mean_std([r['ppl'] for r in rs], '.1f')} | "
                     f"{task_cell} | {rs[0]['cache_vs_fp16_vanilla']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
