"""A tiny Llama-architecture GGUF file, written with the `gguf` package as llama.cpp lays one out: the model's
hyper-parameters under `llama.*`, a byte-level BPE tokenizer (`gpt2`, with merges, control tokens and a
chat template) under `tokenizer.*`, tied embeddings (no `output.weight`, as SmolLM2), Q4_1 projections, a
Q8_0 embedding and F32 norms (the real SmolLM2-135M-Instruct.Q4_1.gguf's mix of types)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

LAYERS, HIDDEN, FFN, HEADS, KV_HEADS = 2, 64, 96, 4, 2
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "Ġ t", "h e"]
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")


def byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode spelling of the 256 bytes, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def vocabulary() -> tuple[list[str], list[int]]:
    tokens = byte_alphabet()
    for merge in dict.fromkeys(MERGES):
        joined = merge.replace(" ", "")
        if joined not in tokens:
            tokens.append(joined)
    types = [1] * len(tokens) + [3] * len(SPECIALS)  # 1 normal, 3 control
    return tokens + SPECIALS, types


def write_tiny_llama_gguf(path: Path, seed: int = 0, architecture: str = "llama") -> Path:
    import gguf

    tokens, types = vocabulary()
    vocab = len(tokens)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny llama")
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(100000.0)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(dict.fromkeys(MERGES)))
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_chat_template(CHAT_TEMPLATE)

    def add(name: str, shape: tuple[int, ...], qtype=None, scale: float = 0.3):
        data = rng.normal(1.0 if name.endswith("norm.weight") else 0.0, scale, size=shape).astype(np.float32)
        if qtype is None:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    q4, q8 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0
    add("token_embd.weight", (vocab, HIDDEN), q8, 0.3)
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (HIDDEN,), None, 0.1)
        add(f"blk.{i}.attn_q.weight", (HEADS * HEAD_DIM, HIDDEN), q4)
        add(f"blk.{i}.attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN), q4)
        add(f"blk.{i}.attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN), q4)
        add(f"blk.{i}.attn_output.weight", (HIDDEN, HEADS * HEAD_DIM), q4)
        add(f"blk.{i}.ffn_norm.weight", (HIDDEN,), None, 0.1)
        add(f"blk.{i}.ffn_gate.weight", (FFN, HIDDEN), q4)
        add(f"blk.{i}.ffn_up.weight", (FFN, HIDDEN), q4)
        add(f"blk.{i}.ffn_down.weight", (HIDDEN, FFN), q4)
    add("output_norm.weight", (HIDDEN,), None, 0.1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
