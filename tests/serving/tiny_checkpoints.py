"""Tiny random FusedKV checkpoints of every plan, and what the transformers model says about them.

Runs in the project's environment (transformers 5.24): vLLM lives in its own environment, so the
serving tests compare the two through files. `write_checkpoints` saves one checkpoint per plan with
`FusedKVForCausalLM.save_pretrained` (safetensors) plus a small byte-level BPE tokenizer;
`reference_outputs` gives the transformers model's greedy tokens (`generate`) and prompt
log-probabilities (a full forward) for each.

Shapes follow what vLLM's CPU attention accepts: head_dim 32 (sizes 32, 64, 80, ... only) and the
caller's block size a multiple of 32. Fusion weights are randomised so that no test leans on their
tidy initial values, and the weights are drawn wide enough that greedy choices are not near-ties.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# One entry per plan the plugin must serve exactly. GQA is a KV-head count, not a sharing plan:
# vanilla (or fusedkv) with fewer KV heads than query heads.
PLANS = {
    "vanilla": dict(kv_sharing="vanilla"),
    "gqa": dict(kv_sharing="vanilla", num_key_value_heads=2),
    "cla": dict(kv_sharing="cla"),
    "yoco": dict(kv_sharing="yoco"),
    "fusedkv-lite": dict(kv_sharing="fusedkv-lite"),
    "fusedkv": dict(kv_sharing="fusedkv"),
    "fusedkv-gqa": dict(kv_sharing="fusedkv", num_key_value_heads=2),
    "fusedkv-dense": dict(kv_sharing="fusedkv-dense"),
    "fusedkv-iterative": dict(kv_sharing="fusedkv", fusion_init="iterative"),
    "reversed": dict(kv_sharing="custom", kv_source_map=[{"layers": [3, 4], "k": 1, "v": 2}]),
    "single-source-scaling": dict(kv_sharing="custom", kv_source_map=[
        {"layers": [3, 4], "k": 2, "v": 1, "k_fusion": "channel", "v_fusion": "channel"}]),
    "two-k-one-v": dict(kv_sharing="custom", kv_source_map=[
        {"layers": [3, 4], "k": [1, 2], "v": 1, "k_fusion": "channel"}]),
}

PROMPTS = [
    "ROMEO: But soft, what light through yonder window breaks?",
    "In the beginning",
    "JULIET: O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name; or, if thou wilt "
    "not, be but sworn my love, and I'll no longer be a Capulet.",
    "To be, or not to be: that is the question.",
]
MAX_NEW_TOKENS = 24

_TEXT = (
    "But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
    "In the beginning God created the heaven and the earth. And the earth was without form, and void. "
    "To be, or not to be: that is the question: whether 'tis nobler in the mind to suffer the slings "
    "and arrows of outrageous fortune, or to take arms against a sea of troubles. "
)


def tiny_config(plan: str, vocab_size: int, **overrides):
    from fusedkv import FusedKVConfig

    base = dict(vocab_size=vocab_size, hidden_size=128, intermediate_size=192, num_hidden_layers=4,
                num_attention_heads=4, head_dim=32, max_position_embeddings=512, initializer_range=0.08,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=0, eos_token_id=0,
                pad_token_id=1, tie_word_embeddings=False)
    base.update(PLANS[plan])
    base.update(overrides)
    return FusedKVConfig(**base)


def write_tokenizer(out_dir: Path, vocab_size: int = 320):
    from fusedkv.data.tokenizer import train_bpe_tokenizer

    return train_bpe_tokenizer([_TEXT] * 20, vocab_size, out_dir, min_frequency=1)


def write_checkpoints(root: Path, plans=tuple(PLANS), seed: int = 0, **overrides) -> dict[str, Path]:
    """Save one tiny random checkpoint per plan under `root/<plan>`; returns {plan: directory}."""
    import shutil

    from fusedkv import FusedKVForCausalLM

    root = Path(root)
    tok_dir = root / "_tokenizer"
    if tok_dir.is_dir():  # an earlier call's: the checkpoints under one root share their tokenizer
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tok_dir)
    else:
        tok = write_tokenizer(tok_dir)
    out = {}
    for plan in plans:
        torch.manual_seed(seed)
        model = FusedKVForCausalLM(tiny_config(plan, len(tok), **overrides)).eval()
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "fusion" in name and model.config.fusion_init != "iterative":
                    p.copy_(torch.randn(p.shape, generator=g) * 0.7 + 0.3)
                elif "fusion" in name:  # the iterative chain compounds: keep its products in range
                    p.copy_(torch.rand(p.shape, generator=g) * 0.8 + 0.4)
        path = root / plan
        model.save_pretrained(path)
        for f in tok_dir.iterdir():
            shutil.copy(f, path / f.name)
        out[plan] = path
    return out


@torch.no_grad()
def reference_outputs(path: Path, prompts=PROMPTS, max_new_tokens: int = MAX_NEW_TOKENS) -> dict:
    """The transformers model's greedy continuation (`generate`) and prompt log-probabilities."""
    from transformers import AutoTokenizer

    from fusedkv import FusedKVForCausalLM

    model = FusedKVForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    rows = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        logits = model(ids, use_cache=False).logits[0].float()
        logprobs = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
        gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=tok.pad_token_id)
        top2 = torch.topk(logits[-1], 2).values
        rows.append({"prompt": prompt, "prompt_ids": ids[0].tolist(), "prompt_logprobs": logprobs.tolist(),
                     "tokens": gen[0, ids.shape[1]:].tolist(), "first_margin": float(top2[0] - top2[1])})
    return {"plan": model.config.kv_sharing, "storage_layers": list(model.plan.storage_layers), "rows": rows}


if __name__ == "__main__":
    import sys

    root = Path(sys.argv[1])
    paths = write_checkpoints(root)
    refs = {plan: reference_outputs(p) for plan, p in paths.items()}
    (root / "reference.json").write_text(json.dumps(refs))
    print(json.dumps({p: str(v) for p, v in paths.items()}))
