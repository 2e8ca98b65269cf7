"""`fusedkv analyze`: the paper's analyses from a trained checkpoint, as PNG files."""

from __future__ import annotations

from pathlib import Path

from .. import argtypes
from ..data import TokenBatches, prepare_dataset
from ..errors import UsageError
from ..model import FusedKVForCausalLM
from .dense import dense_coefficients, plot_dense_heatmaps
from .gradients import plot_gradient_norms, record_gradient_norms


def register(sub) -> None:
    p = sub.add_parser("analyze", help="the paper's analyses as pictures (dense-fusion heat maps, gradient norms)",
                       description="dense: heat maps of the learned coefficients of a fusedkv-dense model "
                       "(Fig. 2; train one with `fusedkv compare dense`). grads: per-layer L2 norms of the "
                       "Q/K/V projection gradients over training steps (Fig. 9).")
    p.add_argument("analysis", choices=["dense", "grads"])
    p.add_argument("checkpoint", type=argtypes.non_empty, help="trained checkpoint directory (with its tokenizer)")
    p.add_argument("--out", default=None, type=argtypes.output_file("analysis.png"),
                   help="PNG path (default: next to the checkpoint)")
    p.add_argument("--steps", type=argtypes.int_range(1, 1_000_000), default=60,
                   help="grads: training steps to record (default 60)")
    p.add_argument("--from-scratch", action="store_true",
                   help="grads: re-initialise the checkpoint's architecture and record from step 0")
    p.add_argument("--batch-size", type=argtypes.int_range(1, 4096), default=8, help="grads: sequences per step")
    p.add_argument("--seq-len", type=argtypes.int_range(2), default=128,
                   help="grads: tokens per sequence, at most the model context (default 128)")
    p.add_argument("--data", default="builtin", type=argtypes.non_empty,
                   help="grads: text source (tokenised with the checkpoint's tokenizer)")
    p.set_defaults(func=run)


def run(args) -> None:
    import torch

    ckpt = Path(args.checkpoint)
    if args.out is not None and (Path(args.out).is_dir() or not Path(args.out).parent.is_dir()):
        raise UsageError(f"--out {args.out}: give a PNG file name in an existing directory")
    model = FusedKVForCausalLM.from_pretrained(ckpt).eval()
    if args.analysis == "dense":
        out = args.out or str(ckpt.parent / "dense_fusion.png")
        k, v, targets, sources = dense_coefficients(model)
        print("key weights (rows: target layers", targets, "; columns: source layers", sources, ")")
        print(k.numpy().round(3))
        print("value weights")
        print(v.numpy().round(3))
        print("wrote", plot_dense_heatmaps(model, out, f"Dense fusion coefficients ({ckpt})"))
        return

    if args.seq_len > model.config.max_position_embeddings:
        raise UsageError(f"--seq-len {args.seq_len} exceeds the model context {model.config.max_position_embeddings}")
    if args.from_scratch:
        torch.manual_seed(0)
        model = FusedKVForCausalLM(model.config)
    data = prepare_dataset(args.data, ckpt.parent / "analysis-data", tokenizer=str(ckpt))
    batches = TokenBatches(data.train, args.seq_len, args.batch_size, seed=0)
    norms = record_gradient_norms(model, batches, args.steps)
    out = args.out or str(ckpt.parent / "gradient_norms.png")
    for side in ("q", "k", "v"):
        last = norms[side][-1]
        print(f"{side}_proj grad norm per layer (last step):", " ".join(f"{x:.3g}" for x in last))
    print("wrote", plot_gradient_norms(norms, out, f"Gradient L2 norms ({model.config.kv_sharing})"))
