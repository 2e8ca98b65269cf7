"""`fusedkv prune CHECKPOINT --sparsity 0.5 --out DIR [--nm 2:4]`: Wanda pruning with calibration
windows from the built-in corpus's training works (never its held-out works), written as an ordinary
checkpoint (weights + config + tokenizer) that every other command loads."""

from __future__ import annotations

from pathlib import Path

from .. import argtypes
from ..flags import add_seed_flag


def register(sub) -> None:
    p = sub.add_parser(
        "prune", help="Wanda pruning (unstructured or N:M) into a new checkpoint",
        description="Prune every decoder block's linear maps by Wanda's score |W_ij| * ||X_j||_2, per output row, "
        "layer by layer from the bottom with each layer's inputs recomputed through the already-pruned layers "
        "below. Input norms come from random windows of the built-in corpus's training works, tokenised with the "
        "checkpoint's tokenizer. Prints the measured sparsity of every matrix.")
    p.add_argument("checkpoint", help="checkpoint directory (config, weights, tokenizer)")
    p.add_argument("--out", required=True, type=argtypes.output_dir, help="output checkpoint directory (new or empty)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out if it already holds files (it is replaced only once the pruned model is "
                   "fully written)")
    p.add_argument("--sparsity", type=argtypes.float_range(0.0, 1.0, hi_open=True), default=None,
                   help="fraction of each row to zero (default 0.5)")
    p.add_argument("--nm", default=None, metavar="N:M", help="semi-structured: zero N of every M inputs, e.g. 2:4")
    p.add_argument("--calib-seqs", type=argtypes.int_range(1, 1_000_000), default=64,
                   help="calibration windows (default 64; Wanda used 128)")
    p.add_argument("--calib-len", type=argtypes.int_range(2), default=None,
                   help="tokens per window (default: the model context)")
    p.add_argument("--batch-size", type=argtypes.int_range(1, 4096), default=8)
    add_seed_flag(p, 0, help="seed for the calibration windows")
    p.set_defaults(func=run)


def run(args) -> None:
    import torch
    from transformers import AutoTokenizer

    from ..model import FusedKVForCausalLM
    from ..model_dirs import check_destination, write_directory_atomically
    from .wanda import builtin_calibration_tokens, calibration_batches, check_prune_settings, parse_nm, wanda_prune

    nm = parse_nm(args.nm)
    sparsity = check_prune_settings(0.5 if args.sparsity is None and nm is None else args.sparsity, nm)
    if args.calib_seqs < 1:
        raise ValueError(f"--calib-seqs {args.calib_seqs}: need at least one calibration window")
    out = Path(args.out)
    check_destination(out, args.overwrite, source=args.checkpoint, what="--out")  # before any work
    model = FusedKVForCausalLM.from_pretrained(args.checkpoint).eval()
    try:
        tok = AutoTokenizer.from_pretrained(args.checkpoint)
    except Exception as e:  # noqa: BLE001 - any tokenizer failure means the same thing to the user
        raise ValueError(f"{args.checkpoint} has no usable tokenizer ({e}); prune a checkpoint saved with one") from e
    seq_len = args.calib_len or model.config.max_position_embeddings
    if not 1 < seq_len <= model.config.max_position_embeddings:
        raise ValueError(f"--calib-len {seq_len}: need 2..{model.config.max_position_embeddings} (the model context)")
    tokens = builtin_calibration_tokens(tok, args.calib_seqs * seq_len, args.seed)
    calibration = calibration_batches(tokens, args.calib_seqs, seq_len, args.batch_size, args.seed)
    torch.manual_seed(args.seed)
    how = f"{nm[0]}:{nm[1]}" if nm else f"{sparsity:g} unstructured"
    print(f"Wanda {how} on {args.calib_seqs} x {seq_len} calibration tokens, "
          f"{len(model.model.layers)} layers")
    report = wanda_prune(model, calibration, sparsity, nm,
                         progress=lambda i: print(f"  layer {i + 1} pruned", flush=True))

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    write_directory_atomically(out, write, args.overwrite)
    width = max(len(r.name) for r in report)
    print(f"\n{'matrix':<{width}}  {'shape':>12}  sparsity")
    for r in report:
        print(f"{r.name:<{width}}  {str(r.shape[0]) + 'x' + str(r.shape[1]):>12}  {r.sparsity:.4f}")
    zeros, total = sum(r.zeros for r in report), sum(r.shape[0] * r.shape[1] for r in report)
    params = sum(p.numel() for p in model.parameters())
    print(f"\nblock linear weights: {zeros:,}/{total:,} zero ({zeros / total:.4f}); "
          f"{zeros / params:.4f} of all {params:,} parameters")
    print(f"wrote {out}")
