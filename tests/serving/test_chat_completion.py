"""A Llama-family checkpoint, converted by `fusedkv convert` and served by `fusedkv serve`, answers a chat
completion with its own chat template (ChatML, as SmolLM2-Instruct's) and the greedy tokens of the source
transformers model in float32.

The checkpoint is a tiny random `LlamaForCausalLM` shaped like SmolLM2 (grouped-query attention, tied
embeddings, RoPE base 100,000) with a byte-level BPE tokenizer, ChatML's special tokens and template, and a
generation_config.json, written by the test (no download)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from tiny_checkpoints import write_tokenizer
from transformers import AutoTokenizer

from tests import _cli as cli_process
from tests.serving.conftest import REPO, vllm_env
from tests.serving.test_vllm_server import post, start_server, stop

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_llama(out: Path) -> Path:
    tok = write_tokenizer(out)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.bos_token, tok.eos_token = "<|im_start|>", "<|im_end|>"
    tok.chat_template = CHATML
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rope_theta=100000.0, tie_word_embeddings=True,
        initializer_range=0.08, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.slow
def test_a_converted_llama_checkpoint_answers_a_chat_completion_as_transformers(vllm_python, tmp_path):
    src = write_llama(tmp_path / "llama")
    dst = tmp_path / "converted"
    converted = cli_process.fusedkv("convert", str(src), str(dst), "--plan", "vanilla", cwd=REPO, env=vllm_env(),
                                    timeout=300)
    assert converted.returncode == 0, converted.stderr[-3000:]
    server = start_server(vllm_python, dst, tmp_path / "server.log")
    try:
        messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Who is there?"}]
        body = {"model": server["model"], "messages": messages, "max_tokens": 12, "temperature": 0,
                "return_token_ids": True, "ignore_eos": True}
        reply = post(server["port"], "/v1/chat/completions", body, key=None)
        log = server["log"].read_text()
    finally:
        stop(server)
    assert "no chat template" not in log  # the checkpoint's own template, carried over by convert
    tok = AutoTokenizer.from_pretrained(dst)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert tok.decode(ids).startswith("<|im_start|>system\nAnswer in one word.<|im_end|>\n")
    assert reply["prompt_token_ids"] == ids
    source = transformers.LlamaForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        prompt = torch.tensor([ids])  # an explicit mask: transformers would take the prompt's <|im_end|> for padding
        expected = source.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                                   eos_token_id=None, pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
    choice = reply["choices"][0]
    assert choice["token_ids"] == expected  # the source model's greedy tokens, in float32
    content = choice["message"]["content"]  # vLLM holds back a trailing incomplete UTF-8 sequence
    assert content and tok.decode(expected, skip_special_tokens=True).startswith(content)


def test_the_converted_checkpoint_chats_in_fusedkv_as_the_source_model(tmp_path):
    """What the server is given, without vLLM: `convert` carries the template and generation_config.json over,
    and `fusedkv chat`'s session answers with the source model's greedy tokens."""
    from fusedkv import FusedKVForCausalLM
    from fusedkv.chat import ChatSession, Sampling, stop_ids
    from fusedkv.convert import convert_checkpoint

    src = write_llama(tmp_path / "llama")
    dst = tmp_path / "converted"
    convert_checkpoint(src, dst, kv_sharing="vanilla")
    assert (dst / "generation_config.json").is_file()
    tok = AutoTokenizer.from_pretrained(dst)
    assert tok.chat_template == CHATML
    model = FusedKVForCausalLM.from_pretrained(dst).eval()
    session = ChatSession(model, tok, Sampling(0.0, None, 1.0, 1.0, 12), stop_ids(model, tok, dst), system="Be brief.")
    assert tok.convert_tokens_to_ids("<|im_end|>") in session.stops
    source = transformers.LlamaForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    for user in ("Who is there?", "And then?"):  # the second turn from the cache the first one left
        ids = tok.apply_chat_template(session.messages(user), add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]
        turn = session.reply(user)
        prompt = torch.tensor([ids])
        with torch.no_grad():  # an explicit mask: transformers would take the prompt's <|im_end|> (= pad) for padding
            expected = source.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                       do_sample=False, eos_token_id=session.stops,
                                       pad_token_id=tok.eos_token_id)[0, len(ids):]
        assert turn.text == tok.decode(expected, skip_special_tokens=True)
