"""Checkpoints carry a chat template, so `/v1/chat/completions` works on them as they are: `fusedkv convert`
keeps the source tokenizer's, and `fusedkv train` saves `DEFAULT_CHAT_TEMPLATE` where its tokenizer has none
(`with_chat_template`; the served end of both: tests/serving/test_vllm_server.py). No vLLM needed."""

from __future__ import annotations

import shutil

import torch
import transformers
from tiny_checkpoints import write_tokenizer
from transformers import AutoTokenizer

from fusedkv.convert import convert_checkpoint
from fusedkv.data.tokenizer import DEFAULT_CHAT_TEMPLATE, with_chat_template

SOURCE_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}<|assistant|>"


def test_convert_keeps_the_source_tokenizers_chat_template(tmp_path):
    tok = write_tokenizer(tmp_path / "tok")
    tok.chat_template = SOURCE_TEMPLATE
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=2, head_dim=32, max_position_embeddings=64)
    torch.manual_seed(0)
    src = tmp_path / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(src)
    tok.save_pretrained(src)
    for plan in ("vanilla", "fusedkv"):
        convert_checkpoint(src, tmp_path / plan, kv_sharing=plan)
        assert AutoTokenizer.from_pretrained(tmp_path / plan).chat_template == SOURCE_TEMPLATE, plan


def test_a_tokenizer_without_a_template_gets_the_documented_default(tmp_path):
    tok = write_tokenizer(tmp_path / "tok")
    assert not tok.chat_template
    with_chat_template(tok).save_pretrained(tmp_path / "saved")
    saved = AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert saved.chat_template == DEFAULT_CHAT_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hello "}]
    assert saved.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "System: Be brief.\n\nUser: Hello\n\nAssistant:")
    shutil.rmtree(tmp_path / "saved")
    tok.chat_template = SOURCE_TEMPLATE  # one of its own is kept
    assert with_chat_template(tok).chat_template == SOURCE_TEMPLATE
