"""Import parity on a real model: fusedkv's vanilla import against transformers' own load of the same weights.

    python benchmarks/real_model_parity.py --hf HF_DIR --fusedkv VANILLA_DIR --text prose.txt,code.txt \\
        [--gguf FILE.gguf] [--json out.json]

1. Perplexity and the largest logit difference on each text (non-overlapping windows of --window tokens,
   the first --tokens tokens), transformers (its GGUF load when --gguf is given, else HF_DIR) against the
   fusedkv import, both float32. HF_DIR must hold the same weights (e.g. the GGUF file dequantised and saved).
2. Where the difference comes from: both against an exact float64 reference (transformers' Llama in
   float64 with its rotary angles computed in float64) at several positions. transformers computes the
   RoPE angles position x inv_freq in float32 even for a float64 model, fusedkv in float64; the angle's
   rounding grows with the position, so beyond a few hundred tokens the two float32 models differ by
   transformers' own rounding, not by fusedkv's.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from fusedkv.model import FusedKVForCausalLM


def load_transformers(args, dtype=torch.float32, attn="sdpa"):
    if args.gguf:
        g = Path(args.gguf)
        return AutoModelForCausalLM.from_pretrained(g.parent, gguf_file=g.name, dtype=dtype,
                                                    attn_implementation=attn).eval()
    return AutoModelForCausalLM.from_pretrained(args.hf, dtype=dtype, attn_implementation=attn).eval()


@torch.inference_mode()
def perplexity_parity(ref, ours, ids: torch.Tensor, window: int) -> dict:
    nll_r = nll_o = 0.0
    n, worst = 0, 0.0
    for s in range(0, ids.shape[1] - 1, window):
        x = ids[:, s:s + window + 1]
        if x.shape[1] < 2:
            break
        lr, lo = ref(x[:, :-1]).logits[0], ours(x[:, :-1]).logits[0]
        worst = max(worst, (lr - lo).abs().max().item())
        nll_r += F.cross_entropy(lr, x[0, 1:], reduction="sum").item()
        nll_o += F.cross_entropy(lo, x[0, 1:], reduction="sum").item()
        n += x.shape[1] - 1
    return dict(tokens=n, window=window, max_abs_logit_diff=worst, ppl_transformers=math.exp(nll_r / n),
                ppl_fusedkv=math.exp(nll_o / n))


@torch.inference_mode()
def exact_reference(args, ids: torch.Tensor) -> torch.Tensor:
    """Logits of transformers' model in float64 with exact (float64) rotary angles. From the checkpoint
    directory even with --gguf: transformers' GGUF load keeps packed weights and computes in float32."""
    model = AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float64, attn_implementation="eager").eval()
    rotary = model.model.rotary_emb
    theta, dim = model.config.rope_parameters["rope_theta"], model.config.head_dim
    if model.config.rope_parameters.get("rope_type", "default") != "default":
        raise SystemExit("the exact reference covers the default RoPE only")
    exact = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)

    def forward(x, position_ids):
        freqs = position_ids.to(torch.float64)[:, :, None] * exact[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    rotary.forward = forward
    return model(ids).logits[0].float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", required=True, help="the transformers checkpoint (its tokenizer is used)")
    ap.add_argument("--gguf", help="compare against transformers' load of this GGUF file instead of --hf")
    ap.add_argument("--fusedkv", required=True, help="the `fusedkv convert --plan vanilla` import")
    ap.add_argument("--text", required=True, help="comma-separated held-out text files")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--positions", default="64,256,1024", help="prefix lengths for the exact-reference check")
    ap.add_argument("--json")
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.hf)
    ref = load_transformers(args)
    ours = FusedKVForCausalLM.from_pretrained(args.fusedkv, dtype=torch.float32).eval()
    out: dict = {"texts": {}}
    texts = args.text.split(",")
    for path in texts:
        ids = tok(Path(path).read_text(), return_tensors="pt")["input_ids"][:, :args.tokens]
        out["texts"][Path(path).stem] = r = perplexity_parity(ref, ours, ids, args.window)
        print(f"{Path(path).stem}: ppl transformers {r['ppl_transformers']:.6f}, fusedkv {r['ppl_fusedkv']:.6f}, "
              f"max |logit diff| {r['max_abs_logit_diff']:.2e} ({r['tokens']} tokens, windows of {args.window})")
    positions = [int(p) for p in args.positions.split(",")]
    ids = tok(Path(texts[0]).read_text(), return_tensors="pt")["input_ids"][:, :max(positions)]
    with torch.inference_mode():
        lo, lt = ours(ids).logits[0], ref(ids).logits[0]
    del ref, ours
    exact = exact_reference(args, ids)
    out["exact_reference"] = {n: {"fusedkv_f32_vs_exact": (lo[:n] - exact[:n]).abs().max().item(),
                                  "transformers_f32_vs_exact": (lt[:n] - exact[:n]).abs().max().item(),
                                  "fusedkv_vs_transformers": (lo[:n] - lt[:n]).abs().max().item()} for n in positions}
    print("| first tokens | fusedkv f32 vs exact f64 | transformers f32 vs exact f64 | fusedkv vs transformers |")
    print("|---|---|---|---|")
    for n, r in out["exact_reference"].items():
        print(f"| {n} | {r['fusedkv_f32_vs_exact']:.1e} | {r['transformers_f32_vs_exact']:.1e} | "
              f"{r['fusedkv_vs_transformers']:.1e} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
