"""Served latent attention (MLA): time a DeepSeek-V3-shaped FusedKV checkpoint in vLLM, one checkout or several.

Builds (once, in --work) a transformers DeepSeek-V3 model with MLA and dense MLPs, converts it to FusedKV
(`fusedkv convert --plan fusedkv`), and runs it through vLLM's offline engine (`fusedkv.serving.offline`,
warmed up, --rounds rounds) with each --code checkout first on PYTHONPATH, alternating the checkouts
--repeats times. Prints wall and CPU seconds per round and whether every checkout generated the same tokens.
To compare with an older commit: `git worktree add /tmp/old COMMIT`, then `--code . /tmp/old`.

    .venv/bin/python benchmarks/serving_mla.py --prompt-len 768 --new-tokens 64 --requests 8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build(work: Path) -> Path:
    ckpt = work / "fusedkv"
    if (ckpt / "config.json").is_file():
        return ckpt
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=256, q_lora_rank=None,
                           moe_intermediate_size=256, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                           n_group=1, topk_group=1,
                           qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, first_k_dense_replace=4,
                           max_position_embeddings=2048, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                           bos_token_id=0, eos_token_id=0, pad_token_id=1)
    DeepseekV3ForCausalLM(cfg).eval().save_pretrained(work / "hf")
    subprocess.run([sys.executable, "-m", "fusedkv.cli", "convert", str(work / "hf"), str(ckpt), "--plan", "fusedkv"],
                   check=True, cwd=REPO)
    return ckpt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default="runs/bench-serving-mla", help="where the checkpoint and results go")
    p.add_argument("--code", nargs="+", default=[str(REPO)], help="checkouts to time (first on PYTHONPATH)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=768)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="times each checkout runs, alternating")
    p.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    args = p.parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    ckpt = build(work)
    rng = random.Random(1)
    prompts = work / "prompts.json"
    prompts.write_text(json.dumps([[rng.randrange(2, 4096) for _ in range(args.prompt_len)]
                                   for _ in range(args.requests)]))
    tokens = {}
    print(f"{args.requests} requests x ({args.prompt_len} + {args.new_tokens}) tokens, {args.rounds} rounds per run")
    for rep in range(args.repeats):
        for i, code in enumerate(args.code):
            out = work / f"run-{i}-{rep}.json"
            env = {**os.environ, "PYTHONPATH": str(Path(code).resolve()), "OMP_NUM_THREADS": "1"}
            subprocess.run([args.vllm_python, "-m", "fusedkv.serving.offline", "--models", str(ckpt),
                            "--prompts", str(prompts), "--max-new-tokens", str(args.new_tokens),
                            "--max-model-len", str(args.prompt_len + args.new_tokens), "--rounds", str(args.rounds),
                            "--out", str(out)], check=True, env=env, capture_output=True)
            r = json.loads(out.read_text())[0]
            tokens.setdefault(code, []).append([row["tokens"] for row in r["rows"]])
            print(f"{code}: wall {', '.join(f'{x:.2f}' for x in r['elapsed_s'])} s, "
                  f"CPU {', '.join(f'{x:.2f}' for x in r['cpu_s'])} s")
    runs = [t for ts in tokens.values() for t in ts]
    print("same greedy tokens in every run:", all(t == runs[0] for t in runs))


if __name__ == "__main__":
    main()
