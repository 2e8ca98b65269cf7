"""`fusedkv eval CHECKPOINT`: held-out loss and perplexity, lm-eval tasks and RULER-style tasks."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser(
        "eval", help="validation loss, perplexity, lm-eval tasks, RULER-style long-context tasks",
        description="Evaluate a checkpoint. By default: loss and perplexity on the built-in corpus's held-out "
        "works (tokenised with the checkpoint's tokenizer) and the shipped offline lm-eval tasks. Add "
        "--text FILE for sliding-window perplexity of any text, --wikitext (needs the hub), --tasks paper "
        "for the paper's seven 5-shot tasks (needs the hub), --ruler for the long-context suite.")
    p.add_argument("checkpoint")
    p.add_argument("--val", default=None,
                   help="token split for validation loss: a prepared dataset dir or a .bin "
                   "(default: the built-in held-out works)")
    p.add_argument("--seq-len", type=int, default=None, help="window for validation loss (default: model context)")
    p.add_argument("--max-batches", type=int, default=100)
    p.add_argument("--text", default=None, help="sliding-window perplexity of this text file")
    p.add_argument("--wikitext", action="store_true", help="WikiText-2 test perplexity (downloads through datasets)")
    p.add_argument("--stride", type=int, default=None, help="sliding-window stride (default: half the window)")
    p.add_argument("--tasks", default="local",
                   help="lm-eval tasks: 'local' (shipped offline tasks), 'paper' (7 tasks, 5-shot), 'none', "
                   "or comma-separated names")
    p.add_argument("--limit", type=float, default=None, help="lm-eval: items per task")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--ruler", action="store_true", help="run the RULER-style synthetic suite")
    p.add_argument("--ruler-lengths", default="512,1024")
    p.add_argument("--ruler-tasks", default=None, help="comma-separated RULER tasks (default: all)")
    p.add_argument("--ruler-samples", type=int, default=10)
    p.add_argument("--ruler-max-new-tokens", type=int, default=None,
                   help="answer budget for every RULER task (default: RULER's per-task budgets, 30-128)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--json", dest="json_path", help="write all results as JSON here")
    p.set_defaults(func=run)


def run(args) -> None:
    import torch
    from transformers import AutoTokenizer

    from ..model import FusedKVForCausalLM

    ckpt = Path(args.checkpoint)
    model = FusedKVForCausalLM.from_pretrained(ckpt).eval()
    tok = AutoTokenizer.from_pretrained(ckpt)
    if len(tok) > model.config.vocab_size:
        raise ValueError(f"{ckpt}: tokenizer has {len(tok)} tokens, model vocab_size={model.config.vocab_size}")
    window = args.seq_len or model.config.max_position_embeddings
    report: dict = {"checkpoint": str(ckpt), "plan": model.config.kv_sharing}

    with torch.inference_mode():
        report["val_loss"] = _validation_loss(model, ckpt, args.val, window, args.batch_size, args.max_batches)
        report["val_ppl"] = math.exp(report["val_loss"])
        print(f"validation loss {report['val_loss']:.4f}   perplexity {report['val_ppl']:.2f}")
        from .perplexity import text_perplexity, wikitext_perplexity

        stride = args.stride or window // 2
        if args.text:
            text = Path(args.text).read_text(encoding="utf-8", errors="replace")
            if not text.strip():
                raise ValueError(f"{args.text} is empty")
            r = text_perplexity(model, tok, text, max_length=window, stride=stride)
            report["text_ppl"] = r["ppl"]
            print(f"{args.text}: perplexity {r['ppl']:.2f} over {r['num_tokens']} tokens "
                  f"(window {window}, stride {stride})")
        if args.wikitext:
            r = wikitext_perplexity(model, tok, max_length=window, stride=stride)
            report["wikitext_ppl"] = r["ppl"]
            print(f"WikiText-2 test perplexity {r['ppl']:.2f}")
    if args.tasks != "none":
        from .harness import LOCAL_GROUP, PAPER_NUM_FEWSHOT, PAPER_TASKS, paper_average, run_lm_eval

        names = {"local": [LOCAL_GROUP], "paper": list(PAPER_TASKS)}.get(args.tasks, args.tasks.split(","))
        shots = args.num_fewshot
        if shots is None and args.tasks == "paper":
            shots = PAPER_NUM_FEWSHOT
        limit = int(args.limit) if args.limit and args.limit >= 1 else args.limit
        res = run_lm_eval(model, tok, tasks=names, num_fewshot=shots, limit=limit,
                          batch_size=args.batch_size)["results"]
        report["tasks"] = res
        for name, metrics in sorted(res.items()):
            if "acc" in metrics:
                norm = f"  acc_norm {metrics['acc_norm']:.4f}" if "acc_norm" in metrics else ""
                print(f"{name}: acc {metrics['acc']:.4f}{norm}")
        if args.tasks == "paper":
            report["paper_avg_acc"] = paper_average(res)
            print(f"paper average accuracy {report['paper_avg_acc']:.2f}")
    if args.ruler:
        from .ruler import format_table, run_ruler

        lengths = [int(x) for x in args.ruler_lengths.split(",")]
        if max(lengths) > model.config.max_position_embeddings:
            raise ValueError(f"--ruler-lengths {max(lengths)} exceeds the model context "
                             f"{model.config.max_position_embeddings}; continue training at a longer context first")
        tasks = args.ruler_tasks.split(",") if args.ruler_tasks else None
        r = run_ruler(model, tok, tasks=tasks, lengths=lengths, num_samples=args.ruler_samples,
                      batch_size=args.batch_size, max_new_tokens=args.ruler_max_new_tokens)
        report["ruler"] = {"scores": r["scores"], "average": r["average"], "overall": r["overall"]}
        print(format_table(r))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=1, default=str))


def _validation_loss(model, ckpt: Path, val: str | None, window: int, batch_size: int, max_batches: int) -> float:
    """Mean token NLL on a token split: a prepared dataset's val.bin, a .bin, or the built-in held-out
    works tokenised with the checkpoint's tokenizer."""
    from ..data import TokenShard, iter_eval_batches, load_prepared_dataset, prepare_dataset
    from .perplexity import validation_loss

    if val is None:
        with tempfile.TemporaryDirectory() as tmp:
            shard = prepare_dataset("builtin", tmp, tokenizer=str(ckpt)).val
            return _loss(model, shard, window, batch_size, max_batches, validation_loss, iter_eval_batches)
    path = Path(val)
    if not path.exists():
        raise ValueError(f"--val {val}: no such file or directory")
    shard = load_prepared_dataset(path).val if path.is_dir() else TokenShard(path)
    if shard.vocab_size and shard.vocab_size > model.config.vocab_size:
        raise ValueError(f"--val {val}: tokens from a {shard.vocab_size}-token vocabulary, model has "
                         f"{model.config.vocab_size}")
    return _loss(model, shard, window, batch_size, max_batches, validation_loss, iter_eval_batches)


def _loss(model, shard, window, batch_size, max_batches, validation_loss, iter_eval_batches) -> float:
    batches = iter_eval_batches(shard, window, batch_size, max_batches=max_batches)
    return float(validation_loss(model, batches, shifted=True))
