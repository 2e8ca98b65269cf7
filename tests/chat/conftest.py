"""A tiny chat checkpoint: a FusedKV model (the half-size cache) with the project's byte-level BPE tokenizer,
ChatML's `<|im_start|>` / `<|im_end|>` special tokens and a ChatML template, saved as one directory.

The model is random, so its answers are arbitrary tokens; its LM head is restricted (other rows zero, so their
logits are 0 and the likeliest of the allowed ones wins) to capitals and digits, characters the tokenizer never
saw in training and so has no merges for. Re-tokenising an answer then gives back the very tokens sampled,
which a real model's answers do as well (they are likely text) and which the KV cache reuse across turns
depends on (fusedkv.chat)."""

from __future__ import annotations

import string
from pathlib import Path

import pytest
import torch

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT = "the quick brown fox jumps over the lazy dog while the cat sleeps on a warm mat by the door\n"
ANSWER_CHARS = string.ascii_uppercase + string.digits
CONTEXT = 128


def write_chat_checkpoint(out: Path, plan: str = "fusedkv", seed: int = 0) -> Path:
    from fusedkv import FusedKVConfig, FusedKVForCausalLM
    from fusedkv.data.tokenizer import train_bpe_tokenizer

    tok = train_bpe_tokenizer([TEXT] * 20, 300, out, min_frequency=1)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHATML
    torch.manual_seed(seed)
    config = FusedKVConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=CONTEXT,
                           kv_sharing=plan, tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
                           eos_token_id=tok.eos_token_id)
    model = FusedKVForCausalLM(config).eval()
    allowed = torch.zeros(len(tok), dtype=torch.bool)
    allowed[tok.convert_tokens_to_ids(list(ANSWER_CHARS))] = True
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "fusion" in name:  # not the tidy initial values
                p.copy_(torch.randn(p.shape, generator=g) * 0.7 + 0.3)
        model.lm_head.weight[~allowed] = 0
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def chat_ckpt(tmp_path_factory) -> Path:
    return write_chat_checkpoint(tmp_path_factory.mktemp("chat") / "ckpt")
