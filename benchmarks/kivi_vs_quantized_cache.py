"""Our KIVI cache (fusedkv.quant) against transformers' QuantizedCache (quanto / HQQ backends), same
model, same held-out windows: loss/perplexity scored token by token through each cache, cache bytes
after one window, and how each backend groups K and V (scale shapes, error on the model's real K/V).

    .venv/bin/python benchmarks/kivi_vs_quantized_cache.py runs/kivi-wanda/fusedkv/final \\
        --val runs/data/builtin-v4096 --windows 8 --group 32 --residual 32

Backends that are not installed (`pip install optimum-quanto torch==2.13.0`, `pip install hqq`) or do
not run here are listed with the reason instead of a number.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from transformers import DynamicCache, QuantizedCache

from fusedkv.cache import kv_cache_nbytes
from fusedkv.data import TokenShard, iter_eval_batches, load_prepared_dataset
from fusedkv.eval.perplexity import validation_loss
from fusedkv.model import FusedKVForCausalLM
from fusedkv.quant import KIVICache, dequantize, kivi_cache_nbytes, quantize_keys, quantize_values
from fusedkv.quant.scoring import DecodeScorer


def held_out_batches(val: str, seq_len: int, windows: int):
    from pathlib import Path

    path = Path(val)
    shard = load_prepared_dataset(path).val if path.is_dir() else TokenShard(path)
    return list(iter_eval_batches(shard, seq_len, batch_size=windows, max_batches=1))


def tensor_bytes(obj, seen: dict) -> None:
    """Walk tensors (quanto's tensor subclasses through __tensor_flatten__, HQQ's (tensor, meta) pairs)
    and record each underlying storage once."""
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor:
            names, _ = obj.__tensor_flatten__()
            for n in names:
                tensor_bytes(getattr(obj, n), seen)
            return
        s = obj.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            tensor_bytes(x, seen)
    elif isinstance(obj, dict):
        for x in obj.values():
            tensor_bytes(x, seen)


def quantized_cache_nbytes(cache) -> int:
    seen: dict = {}
    for layer in cache.layers:
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            tensor_bytes(getattr(layer, name, None), seen)
    return sum(seen.values())


def cache_kinds(bits_list, group, residual):
    kinds = {"fp32 (DynamicCache)": lambda cfg: DynamicCache(config=cfg)}
    for bits in bits_list:
        kinds[f"KIVI-{bits} (fusedkv.quant)"] = lambda cfg, b=bits: KIVICache(cfg, b, group, residual)
    for backend in ("quanto", "hqq"):
        for bits in bits_list:
            kinds[f"{backend}-{bits} (transformers QuantizedCache)"] = (
                lambda cfg, b=bits, be=backend: QuantizedCache(be, cfg, nbits=b, q_group_size=group,
                                                               residual_length=residual))
    return kinds


def scale_shapes(cache) -> str:
    """How a filled cache groups its first storage layer: the shapes of its scales."""
    layer = cache.layers[0]
    if isinstance(cache, KIVICache):
        if layer.quantized_keys is None:
            return "-"
        return f"K scale {tuple(layer.quantized_keys.scale.shape)}, V scale {tuple(layer.quantized_values.scale.shape)}"
    qk = getattr(layer, "_quantized_keys", None)
    if qk is None:
        return "-"
    if isinstance(qk, tuple):  # HQQ: (codes, meta)
        return f"K scale {tuple(qk[1]['scale'].shape)}, V scale {tuple(layer._quantized_values[1]['scale'].shape)}"
    return f"K scale {tuple(qk._scale.shape)}, V scale {tuple(layer._quantized_values._scale.shape)}"


def real_kv_errors(model, ids, bits, group):
    """Relative error of quantising the model's real K/V of the first storage layer: KIVI's grouping
    against per-token keys / per-channel values (the grouping the paper argues against, KIVI Sec. 3)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    k, v = cache.layers[0].keys, cache.layers[0].values
    t = (k.shape[2] // group) * group
    k, v = k[:, :, :t], v[:, :, :t]

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    per_token_k = dequantize(quantize_values(k, bits, group))  # keys grouped along channels, per token
    per_channel_v = dequantize(quantize_keys(v, bits, group))  # values grouped along tokens, per channel
    return {"K per-channel (KIVI)": rel(dequantize(quantize_keys(k, bits, group)), k),
            "K per-token": rel(per_token_k, k),
            "V per-token (KIVI)": rel(dequantize(quantize_values(v, bits, group)), v),
            "V per-channel": rel(per_channel_v, v)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+")
    p.add_argument("--val", required=True, help="prepared dataset dir (its val split) or a .bin of held-out tokens")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--bits", default="4,2")
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--residual", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    bits_list = [int(b) for b in args.bits.split(",")]
    for ckpt in args.checkpoints:
        model = FusedKVForCausalLM.from_pretrained(ckpt).eval()
        seq_len = args.seq_len or model.config.max_position_embeddings
        batches = held_out_batches(args.val, seq_len, args.windows)
        ids = batches[0][0]
        print(f"\n## {ckpt}: plan {model.config.kv_sharing}, {ids.shape[0]} held-out windows x {seq_len} tokens, "
              f"G={args.group}, R={args.residual}, token-by-token scoring\n")
        with torch.no_grad():
            full = validation_loss(model, batches, shifted=True)
        print(f"one full-sequence forward (no cache): loss {full:.4f}\n")
        print("| cache | loss | ppl | bytes after 1 window (batch 1) | vs fp32 | formula | grouping | s |")
        print("|---|---|---|---|---|---|---|---|")
        for name, make in cache_kinds(bits_list, args.group, args.residual).items():
            try:
                t0 = time.perf_counter()
                loss = validation_loss(DecodeScorer(model, make), batches, shifted=True)
                elapsed = time.perf_counter() - t0
                one = DecodeScorer(model, make)(ids[:1, :-1]).cache  # cache after one window of batch 1
            except Exception as e:  # noqa: BLE001 - report why a backend does not run here
                why = f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"
                print(f"| {name} | - | - | - | - | - | not run: {why} | - |")
                continue
            if isinstance(one, KIVICache):
                nbytes = one.nbytes()
                bits = one.bits
                formula = kivi_cache_nbytes(model.config, seq_len - 1, 1, bits, args.group, args.residual)
            elif isinstance(one, QuantizedCache):
                nbytes, formula = quantized_cache_nbytes(one), None
            else:
                nbytes, formula = kv_cache_nbytes(one), None
                fp32_bytes = nbytes
            print(f"| {name} | {loss:.4f} | {math.exp(loss):.2f} | {nbytes:,} | {nbytes / fp32_bytes:.3f} | "
                  f"{'-' if formula is None else f'{formula:,}'} | {scale_shapes(one)} | {elapsed:.0f} |")
        for bits in bits_list:
            errs = real_kv_errors(model, ids[:1], bits, args.group)
            print(f"\n{bits}-bit relative error on the first storage layer's real K/V: "
                  + ", ".join(f"{k} {v:.4f}" for k, v in errs.items()))


if __name__ == "__main__":
    main()
