"""Write a vanilla fusedkv model as a Hugging Face Qwen3 checkpoint (transformers' own `Qwen3ForCausalLM`).

A vanilla fusedkv model is Qwen3 layer for layer, with Qwen3's weight names (fusedkv/convert: a vanilla
conversion gives transformers' logits), so its weights load into `Qwen3ForCausalLM` unchanged. This is how
docs/uptraining.md makes a small *pretrained* Qwen3 to uptrain on a CPU: pre-train with
`fusedkv train --plan vanilla`, export, then `fusedkv uptrain` the export as any Qwen3 checkpoint.

    python scripts/export_qwen3.py runs/tiny-vanilla/final runs/tiny-qwen3

Checks, before writing, that transformers' model gives the fusedkv model's logits (float32, 1e-4).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from fusedkv import FusedKVForCausalLM
from fusedkv.plan import VANILLA

FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "initializer_range",
          "tie_word_embeddings", "attention_bias", "hidden_act", "bos_token_id", "eos_token_id", "pad_token_id",
          "rope_parameters")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="a vanilla fusedkv model directory (e.g. runs/tiny-vanilla/final)")
    ap.add_argument("dst", help="output directory for the Qwen3 checkpoint")
    args = ap.parse_args()
    model = FusedKVForCausalLM.from_pretrained(args.src).float().eval()
    c = model.config
    windowed = set(c.layer_types or []) - {"full_attention"}
    if c.kv_sharing != VANILLA or c.num_experts or c.kv_lora_rank is not None or windowed:
        raise SystemExit(f"{args.src}: only a dense vanilla fusedkv model without window layers is a Qwen3 model")
    qwen3 = Qwen3ForCausalLM(Qwen3Config(**{k: getattr(c, k) for k in FIELDS})).eval()
    qwen3.load_state_dict(model.state_dict(), strict=True)
    ids = torch.randint(0, c.vocab_size, (2, min(64, c.max_position_embeddings)),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (qwen3(ids).logits - model(ids).logits).abs().max().item()
    if diff > 1e-4:
        raise SystemExit(f"transformers' Qwen3 differs from the fusedkv model by {diff:.2e}; not written")
    qwen3.save_pretrained(args.dst)
    for f in Path(args.src).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy2(f, Path(args.dst) / f.name)
    print(f"wrote {args.dst}: Qwen3ForCausalLM, logits within {diff:.1e} of {args.src}")


if __name__ == "__main__":
    main()
