"""`fusedkv eval CHECKPOINT`: held-out loss and perplexity, lm-eval tasks and RULER-style tasks."""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

from .. import argtypes
from ..data import TokenShard, iter_eval_batches, load_prepared_dataset, prepare_dataset, read_text_file
from ..data.ruler_tasks import TASKS
from ..data.tokenizer import check_same_tokenizer
from ..errors import UsageError, writing
from ..flags import add_kivi_flags, kv_group
from ..model import FusedKVForCausalLM
from ..model_dirs import check_checkpoint_dir
from ..quant import KIVICache, check_kivi_settings
from ..quant.scoring import DecodeScorer
from ..utils import write_json_atomic
from .harness import LOCAL_GROUP, PAPER_NUM_FEWSHOT, PAPER_TASKS, paper_average, run_lm_eval
from .perplexity import text_perplexity, validation_loss, wikitext_perplexity
from .retrieval import format_retrieval, plot_retrieval, run_retrieval
from .ruler import format_table, run_ruler


def register(sub) -> None:
    p = sub.add_parser(
        "eval", help="validation loss, perplexity, lm-eval tasks, RULER-style long-context tasks",
        description="Evaluate a checkpoint. By default: loss and perplexity on the built-in corpus's held-out "
        "works (tokenised with the checkpoint's tokenizer) and the shipped offline lm-eval tasks. Add "
        "--text FILE for sliding-window perplexity of any text, --wikitext (needs the hub), --tasks paper "
        "for the paper's seven 5-shot tasks (needs the hub), --ruler for the long-context suite. A loss that "
        "is not finite (corrupt weights) is an error (exit 1), never a number.")
    p.add_argument("checkpoint", type=argtypes.non_empty, help="checkpoint directory (config, weights, tokenizer)")
    p.add_argument("--val", default=None, type=argtypes.non_empty,
                   help="token split for validation loss: a prepared dataset dir or a .bin "
                   "(default: the built-in held-out works)")
    p.add_argument("--seq-len", type=argtypes.int_range(2), default=None,
                   help="window for validation loss and perplexity, at most the model context (default: it)")
    p.add_argument("--max-batches", type=argtypes.positive_int, default=100,
                   help="validation batches (default 100)")
    p.add_argument("--text", default=None, type=argtypes.non_empty,
                   help="sliding-window perplexity of this UTF-8 text file")
    p.add_argument("--wikitext", action="store_true", help="WikiText-2 test perplexity (downloads through datasets)")
    p.add_argument("--stride", type=argtypes.positive_int, default=None,
                   help="sliding-window stride (default: half the window)")
    p.add_argument("--tasks", default="local", type=argtypes.non_empty,
                   help="lm-eval tasks: 'local' (shipped offline tasks), 'paper' (7 tasks, 5-shot), 'none', "
                   "or comma-separated names")
    p.add_argument("--limit", type=argtypes.float_range(0, lo_open=True), default=None,
                   help="lm-eval: items per task (a number below 1 is a fraction of each task)")
    p.add_argument("--num-fewshot", type=argtypes.non_negative_int, default=None,
                   help="lm-eval: examples in each prompt (default: each task's)")
    p.add_argument("--ruler", action="store_true", help="run the RULER-style synthetic suite")
    p.add_argument("--ruler-lengths", type=argtypes.int_list(2), default=[512, 1024],
                   help="comma-separated context lengths, each at most the model context (default 512,1024)")
    p.add_argument("--ruler-tasks", type=argtypes.name_list(), default=None,
                   help="comma-separated RULER tasks (default: all)")
    p.add_argument("--ruler-samples", type=argtypes.positive_int, default=10, help="samples per task and length")
    p.add_argument("--ruler-max-new-tokens", type=argtypes.positive_int, default=None,
                   help="answer budget for every RULER task (default: RULER's per-task budgets, 30-128)")
    p.add_argument("--retrieval", action="store_true",
                   help="synthetic retrieval accuracy: MQAR by pairs x length, passkey by length")
    p.add_argument("--retrieval-lengths", type=argtypes.int_list(2), default=None,
                   help="comma-separated lengths for --retrieval, each at most the model context (default: the "
                   "context, halved twice)")
    p.add_argument("--retrieval-pairs", type=argtypes.int_list(1), default=[4, 8, 16],
                   help="comma-separated MQAR key-value pair counts (default 4,8,16)")
    p.add_argument("--retrieval-samples", type=argtypes.positive_int, default=20,
                   help="samples per --retrieval cell (default 20)")
    p.add_argument("--retrieval-plot", default=None, type=argtypes.output_file("retrieval.png"),
                   help="write the --retrieval accuracy-against-length plot (PNG) here")
    p.add_argument("--batch-size", type=argtypes.positive_int, default=4)
    add_kivi_flags(p, "score loss and perplexity token by token through a KIVI 2/4-bit KV cache (fusedkv.quant)")
    p.add_argument("--json", dest="json_path", type=argtypes.output_file("eval.json"),
                   help="write all results as JSON here")
    p.set_defaults(func=run)


def _check_inputs(args) -> None:
    """Every path and name the flags give, checked before the model is loaded or any work is done."""
    if args.text is not None and not Path(args.text).is_file():
        what = "is a directory" if Path(args.text).is_dir() else "does not exist"
        raise UsageError(f"--text {args.text} {what}; give a text file")
    if args.val is not None and not Path(args.val).exists():
        raise UsageError(f"--val {args.val}: no such file or directory")
    if args.json_path is not None:
        out = Path(args.json_path)
        if out.is_dir():
            raise UsageError(f"--json {out} is a directory; give a file name")
        if not out.parent.is_dir():
            raise UsageError(f"--json {out}: directory {out.parent} does not exist")
    if getattr(args, "retrieval_plot", None) is not None and not Path(args.retrieval_plot).parent.is_dir():
        raise UsageError(f"--retrieval-plot {args.retrieval_plot}: directory {Path(args.retrieval_plot).parent} "
                         "does not exist")
    if args.ruler_tasks:
        unknown = [t for t in args.ruler_tasks if t not in TASKS]
        if unknown:
            raise UsageError(f"--ruler-tasks: unknown task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)}")
    if args.tasks not in ("local", "paper", "none"):
        names = [t.strip() for t in args.tasks.split(",") if t.strip()]
        if not names:
            raise UsageError("--tasks: no task names given; use local, paper, none or comma-separated names")


def run(args) -> None:
    import torch
    from transformers import AutoTokenizer

    _check_inputs(args)
    text = read_text_file(args.text) if args.text else None  # a binary file is refused before the model loads
    if text is not None and not text.strip():
        raise UsageError(f"--text {args.text} is empty")
    ckpt = Path(args.checkpoint)
    check_checkpoint_dir(ckpt)  # its errors first (from_pretrained does not repeat the work)
    tok = AutoTokenizer.from_pretrained(ckpt)
    val_shard = _open_val(args.val, ckpt, tok) if args.val else None  # same tokenizer, before the model loads
    model = FusedKVForCausalLM.from_pretrained(ckpt).eval()
    if len(tok) > model.config.vocab_size:
        raise ValueError(f"{ckpt}: tokenizer has {len(tok)} tokens, model vocab_size={model.config.vocab_size}")
    context = model.config.max_position_embeddings
    if args.seq_len and args.seq_len > context:
        raise UsageError(f"--seq-len {args.seq_len} exceeds the model context {context}; use at most {context}")
    if args.ruler and max(args.ruler_lengths) > context:
        raise UsageError(f"--ruler-lengths {max(args.ruler_lengths)} exceeds the model context {context}; "
                         "continue training at a longer context first")
    retrieval_lengths = args.retrieval_lengths or [context // 4, context // 2, context]
    if args.retrieval and max(retrieval_lengths) > context:
        raise UsageError(f"--retrieval-lengths {max(retrieval_lengths)} exceeds the model context {context}; "
                         "continue training at a longer context first (fusedkv train --init-from ... --rope-base ...)")
    if args.ruler:
        budget = args.ruler_max_new_tokens or max(TASKS[t].max_new_tokens for t in args.ruler_tasks or TASKS)
        if min(args.ruler_lengths) <= budget:
            raise UsageError(f"--ruler-lengths {min(args.ruler_lengths)} leaves no room for a prompt: the answer "
                             f"budget is {budget} tokens (--ruler-max-new-tokens); use longer lengths")
    window = args.seq_len or context
    report: dict = {"checkpoint": str(ckpt), "plan": model.config.kv_sharing}
    scored = model
    if args.kv_bits:  # KIVI changes only what decoding sees: score one token per forward through its cache
        group = kv_group(args, model.config.head_dim)
        check_kivi_settings(args.kv_bits, group, args.kv_residual, model.config.head_dim)
        scored = DecodeScorer(model, lambda cfg: KIVICache(cfg, args.kv_bits, group, args.kv_residual))
        report["kv_cache"] = {"kivi_bits": args.kv_bits, "group": group, "residual": args.kv_residual}
        print(f"KIVI {args.kv_bits}-bit KV cache (G={group}, R={args.kv_residual}): loss and perplexity "
              "scored token by token through it (lm-eval tasks score prefills, which KIVI keeps in full precision)")

    with torch.inference_mode():
        report["val_loss"] = _validation_loss(scored, ckpt, val_shard, window, args.batch_size, args.max_batches)
        report["val_ppl"] = math.exp(report["val_loss"])
        print(f"validation loss {report['val_loss']:.4f}   perplexity {report['val_ppl']:.2f}")

        stride = args.stride or window // 2
        if text is not None:
            r = text_perplexity(scored, tok, text, max_length=window, stride=stride)
            report["text_ppl"] = r["ppl"]
            print(f"{args.text}: perplexity {r['ppl']:.2f} over {r['num_tokens']} tokens "
                  f"(window {window}, stride {stride})")
        if args.wikitext:
            r = wikitext_perplexity(scored, tok, max_length=window, stride=stride)
            report["wikitext_ppl"] = r["ppl"]
            print(f"WikiText-2 test perplexity {r['ppl']:.2f}")
    if args.tasks != "none":
        names = {"local": [LOCAL_GROUP], "paper": list(PAPER_TASKS)}.get(args.tasks, args.tasks.split(","))
        shots = args.num_fewshot
        if shots is None and args.tasks == "paper":
            shots = PAPER_NUM_FEWSHOT
        limit = int(args.limit) if args.limit and args.limit >= 1 else args.limit
        try:
            res = run_lm_eval(model, tok, tasks=names, num_fewshot=shots, limit=limit,
                              batch_size=args.batch_size)["results"]
        except KeyError as e:
            if "not a registered task" not in str(e):
                raise
            raise UsageError(f"--tasks {args.tasks}: {e.args[0]} (lm_eval --tasks list shows them)") from None
        report["tasks"] = res
        for name, metrics in sorted(res.items()):
            if "acc" in metrics:
                norm = f"  acc_norm {metrics['acc_norm']:.4f}" if "acc_norm" in metrics else ""
                print(f"{name}: acc {metrics['acc']:.4f}{norm}")
        if args.tasks == "paper":
            report["paper_avg_acc"] = paper_average(res)
            print(f"paper average accuracy {report['paper_avg_acc']:.2f}")
    if args.ruler:
        r = run_ruler(model, tok, tasks=args.ruler_tasks, lengths=args.ruler_lengths, num_samples=args.ruler_samples,
                      batch_size=args.batch_size, max_new_tokens=args.ruler_max_new_tokens)
        report["ruler"] = {"scores": r["scores"], "average": r["average"], "overall": r["overall"]}
        print(format_table(r))
    if args.retrieval:
        r = run_retrieval(model, tok, lengths=retrieval_lengths, pairs=args.retrieval_pairs,
                          num_samples=args.retrieval_samples, batch_size=args.batch_size)
        report["retrieval"] = r
        print(format_retrieval(r))
        if args.retrieval_plot:
            print(f"wrote {plot_retrieval({report['plan']: r}, args.retrieval_plot, f'{ckpt} retrieval accuracy')}")
    if args.json_path:
        with writing(args.json_path):
            write_json_atomic(args.json_path, report, default=str)


def _open_val(val: str, ckpt: Path, tok):
    """The token split `--val` names (a prepared dataset's val.bin, or a .bin), refused unless it was
    tokenised with the checkpoint's tokenizer (the hash its metadata records)."""
    path = Path(val)
    if not path.exists():
        raise UsageError(f"--val {val}: no such file or directory")
    shard = load_prepared_dataset(path).val if path.is_dir() else TokenShard(path)
    if not check_same_tokenizer(shard.meta.get("tokenizer_sha256"), tok, f"--val {val}", str(ckpt)):
        print(f"fusedkv eval: warning: --val {val} records no tokenizer hash, so it cannot be checked against "
              f"{ckpt}'s tokenizer", file=sys.stderr)
    if shard.vocab_size and shard.vocab_size > len(tok):
        raise UsageError(f"--val {val}: tokens from a {shard.vocab_size}-token vocabulary, {ckpt}'s tokenizer "
                         f"has {len(tok)}")
    return shard


def _validation_loss(model, ckpt: Path, shard, window: int, batch_size: int, max_batches: int) -> float:
    """Mean token NLL on a token split (`_open_val`), or on the built-in held-out works tokenised with the
    checkpoint's tokenizer when `shard` is None."""
    if shard is None:
        with tempfile.TemporaryDirectory() as tmp:
            return _loss(model, prepare_dataset("builtin", tmp, tokenizer=str(ckpt)).val, window, batch_size,
                         max_batches)
    return _loss(model, shard, window, batch_size, max_batches)


def _loss(model, shard, window, batch_size, max_batches) -> float:
    batches = iter_eval_batches(shard, window, batch_size, max_batches=max_batches)
    return float(validation_loss(model, batches, shifted=True))
