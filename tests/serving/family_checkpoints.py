"""Tiny random checkpoints of the dense families `fusedkv convert` imports, built with transformers' own
classes, converted to vanilla and to a half-cache plan, and what the reference says about each.

Runs in the project's environment (transformers 5.24); vLLM runs in its own (tests/serving/conftest.py).
Shapes follow what vLLM's CPU attention accepts (head_dim 32). Every family feature the model has is
switched on somewhere: Q/K/V and MLP biases, Qwen2's bias-free output projection, tied embeddings, no
QK-norm, the llama3 / YaRN / dynamic / linear RoPE scalings, Gemma's RMSNorm (1 + w), post-norms,
embedding scaling, GeGLU (tanh-GELU), query_pre_attn_scalar, attention and final logit soft-capping, a
separate local RoPE base, and sliding-window layers (every layer: Mistral; alternating: Gemma) whose
window is shorter than the prompts.

The reference is transformers' own `generate` for vanilla imports and fusedkv's `generate` for the
plans (a converted model is fusedkv's, not transformers'); prompt log-probabilities come from fusedkv's
full forward (equal to transformers' within 1e-5 for vanilla imports: tests/convert/test_families.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

VOCAB = 256
WINDOW = 8
SLIDE, FULL = "sliding_attention", "full_attention"
SHAPE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=256, initializer_range=0.1,
             bos_token_id=None, eos_token_id=None, pad_token_id=0)

# family id -> (transformers causal-LM class, config class, fields, plans served besides vanilla)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(
        attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}), ["fusedkv"]),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(
        sliding_window=WINDOW, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                "original_max_position_embeddings": 64}),
                ["fusedkv", "fusedkv-lite"]),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}), ["fusedkv-lite"]),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        sliding_window=WINDOW, sliding_window_pattern=2, query_pre_attn_scalar=24, final_logit_softcapping=30.0,
        tie_word_embeddings=False,
        rope_parameters={FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                         SLIDE: {"rope_type": "default", "rope_theta": 1e4}}), ["fusedkv", "yoco"]),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(
        sliding_window=WINDOW, query_pre_attn_scalar=32, attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=False), ["fusedkv-lite", "fusedkv"]),
}

# Token-id prompts: longer than the window, spanning several 32-token cache blocks.
PROMPT_LENGTHS = (45, 13, 70)
MAX_NEW_TOKENS = 16


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def build_source(family: str, root: Path):
    """(directory saved by `save_pretrained`, the transformers model) for one family."""
    model_class, config_class, fields, _ = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**SHAPE, **fields})
    config._attn_implementation = "eager"  # the plain reference (Gemma 2's soft-capping needs it)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # Gemma's norms start at a gain of 1 (w = 0): give them values that matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.2)
    path = root / family / "source"
    model.save_pretrained(path)
    return path, model


def randomize_fusion(path: Path, seed: int = 1) -> None:
    """Give a converted plan's fusion weights values away from their tidy initialisation, and re-save."""
    from fusedkv import FusedKVForCausalLM

    model = FusedKVForCausalLM.from_pretrained(path).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".fusion." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 + 0.5)
    model.save_pretrained(path)


@torch.no_grad()
def reference(path: Path, source_model=None) -> dict:
    """Greedy tokens (transformers' `generate` of `source_model` if given, else fusedkv's) and the prompt
    log-probabilities of fusedkv's full forward, for `prompts()`."""
    from fusedkv import FusedKVForCausalLM

    model = FusedKVForCausalLM.from_pretrained(path).eval()
    rows = []
    for prompt in prompts():
        ids = torch.tensor([prompt])
        logprobs = torch.log_softmax(model(ids, use_cache=False).logits[0].float(), -1)
        generator = source_model if source_model is not None else model
        out = generator.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        rows.append({"tokens": out[0, ids.shape[1]:].tolist(),
                     "prompt_logprobs": logprobs[:-1].gather(-1, ids[0, 1:, None])[:, 0].tolist()})
    return {"rows": rows, "storage_layers": list(model.plan.storage_layers)}


def write_family_checkpoints(root: Path) -> tuple[dict[str, Path], dict]:
    """Every family as vanilla and under its plans: ({"family/plan": directory}, {family: the transformers
    model}); `references` gives what the reference says about them."""
    from fusedkv.convert import convert_checkpoint

    root = Path(root)
    paths, sources = {}, {}
    for family, (_, _, _, plans) in FAMILIES.items():
        src, sources[family] = build_source(family, root)
        for plan in ["vanilla", *plans]:
            key = f"{family}/{plan}"
            dst = root / family / plan
            convert_checkpoint(src, dst, kv_sharing=plan)
            if plan != "vanilla":
                randomize_fusion(dst)
            paths[key] = dst
    return paths, sources


def references(paths: dict[str, Path], sources: dict) -> dict[str, dict]:
    """{"family/plan": reference} for write_family_checkpoints' checkpoints."""
    refs = {}
    for key, path in paths.items():
        family, plan = key.split("/")
        refs[key] = reference(path, sources[family] if plan == "vanilla" else None)
    return refs
