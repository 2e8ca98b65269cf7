"""Shared fixtures for the evaluation tests: a tiny BPE tokenizer trained here and a tiny random Qwen3.

Everything is built in-process from text written in this file, so the tests never touch a hub.
The model is transformers' own ``Qwen3ForCausalLM``: our ``FusedKVForCausalLM`` exposes the same
interface (``model(input_ids, attention_mask=...).logits`` and ``model.generate``), so the evaluation
code is written and tested against the reference implementation.
"""

from __future__ import annotations

import random

import pytest
import torch

# A few KB of plain English, numbers and hyphenated words: enough for a byte-level BPE of ~400 merges
# to learn common words, digits and the vocabulary the RULER templates use.
_WORDS = (
    "the grass is green and the sky is blue while the sun is yellow here we go there and back again "
    "one of the special magic numbers for a key is hidden within the following text make sure to "
    "memorize it i will quiz you about the numbers afterwards what are all the special magic values "
    "mentioned in the provided text question answer according to the chain of variable assignment "
    "below is a numbered list of words some appear more often than others read the coded text and "
    "track the frequency of each word a river flows to the sea the farmer planted wheat in spring "
    "water boils at one hundred degrees plants need light to grow the moon moves around the earth "
    "iron is a metal that rusts in damp air sound travels faster in water than in air"
).split()


def make_corpus(n_sentences: int = 400, seed: int = 0) -> str:
    """Pseudo-English text (deterministic) used to train the tokenizer and as a haystack."""
    rng = random.Random(seed)
    sents = []
    for _ in range(n_sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 14))]
        if rng.random() < 0.3:
            words.insert(rng.randint(0, len(words)), str(rng.randint(0, 99999)))
        if rng.random() < 0.2:
            words.insert(rng.randint(0, len(words)), f"{rng.choice(_WORDS)}-{rng.choice(_WORDS)}")
        s = " ".join(words)
        sents.append(s[0].upper() + s[1:] + rng.choice([".", ".", ".", "?", "!"]))
    return " ".join(sents)


@pytest.fixture(scope="session")
def corpus_text() -> str:
    return make_corpus()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, corpus_text):
    """Train a byte-level BPE (~400 tokens) and save it as a PreTrainedTokenizerFast directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    extra = "ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz 0123456789 - = : , . ? ! ' \" ( )\n"
    tok.train_from_iterator([corpus_text, extra * 5], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    out = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def tiny_qwen3(vocab_size: int, eos_id: int, pad_id: int, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        max_position_embeddings=4096,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=eos_id,
        tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def model(tokenizer):
    return tiny_qwen3(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory, model, tokenizer):
    """The tiny model and tokenizer saved together, as ``lm_eval --model hf`` expects."""
    out = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
