"""Chat with an instruct checkpoint: its own chat template, a history kept within the context, streamed
answers from the package's decode loop (`fusedkv.generation.generate`), the KV cache kept across turns.

One turn: the history (system prompt, earlier exchanges, the new user message) goes through the tokenizer's
chat template with the generation prompt (`apply_chat_template(..., add_generation_prompt=True)`, the ids
transformers and vLLM would feed), the answer is sampled token by token until one of the end-of-turn ids
(`stop_ids`), and its text is printed as it grows (`TextStream`: only complete UTF-8 characters).

Settings: the checkpoint's `generation_config.json` (transformers' `GenerationConfig`: do_sample,
temperature, top_k, top_p, repetition_penalty, max_new_tokens) where it sets them, `CHAT_DEFAULTS`
otherwise, command-line flags over both (`sampling_settings`).

Context: when the history no longer leaves room for an answer, the oldest exchanges are dropped (the system
prompt stays) and the caller is told. The KV cache (the plan's half-size `StaticKVCache`) is kept across
turns: a new turn's ids start with the previous turn's prompt and answer, so only the new tokens are
prefilled (`generate(cache=...)`). When the ids do not extend what is cached -- the template re-tokenised an
answer differently, or dropped turns shifted every position (RoPE) -- or the cache is too small, the history
is prefilled again into a fresh cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .cache import StaticKVCache
from .errors import UsageError
from .generation import generate

# Sampling when the checkpoint's generation_config.json says nothing: moderate temperature and nucleus
# sampling, the settings instruct models' cards commonly recommend (greedy decoding loops on small models).
CHAT_DEFAULTS = {"do_sample": True, "temperature": 0.7, "top_k": 50, "top_p": 0.9, "repetition_penalty": 1.0,
                 "max_new_tokens": 512}
# End-of-turn tokens of common chat templates (ChatML, Llama 3, Gemma, Phi): a stop wherever the vocabulary has one.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")
CACHE_BLOCK = 1024  # cache capacity grows in these steps (and doubles), up to the model's context


@dataclass
class Sampling:
    temperature: float  # 0 = greedy
    top_k: int | None
    top_p: float
    repetition_penalty: float
    max_new_tokens: int


def sampling_settings(checkpoint, temperature=None, top_k=None, top_p=None, repetition_penalty=None,
                      max_new_tokens=None, greedy: bool = False) -> tuple[Sampling, str]:
    """The answer's sampling: flags (not None) over the checkpoint's generation_config.json over CHAT_DEFAULTS.
    Returns it with a few words saying where it came from."""
    from transformers import GenerationConfig

    given, source = {}, "fusedkv's chat defaults"
    if (Path(checkpoint) / "generation_config.json").is_file():
        try:  # what the file sets (GenerationConfig checks it): its defaults (greedy) are no choice of the author's
            GenerationConfig.from_pretrained(checkpoint)
            given = json.loads((Path(checkpoint) / "generation_config.json").read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"{checkpoint}/generation_config.json is unreadable ({e}); fix or delete it") from e
        keys = [k for k in CHAT_DEFAULTS if given.get(k) is not None]
        source = f"generation_config.json ({', '.join(keys)})" if keys else source
    pick = {k: given.get(k) if given.get(k) is not None else v for k, v in CHAT_DEFAULTS.items()}
    flags = {"temperature": temperature, "top_k": top_k, "top_p": top_p,
             "repetition_penalty": repetition_penalty, "max_new_tokens": max_new_tokens}
    pick.update({k: v for k, v in flags.items() if v is not None})
    if temperature is not None:
        pick["do_sample"] = temperature > 0
    sample = pick["do_sample"] and not greedy and pick["temperature"] > 0
    return Sampling(temperature=float(pick["temperature"]) if sample else 0.0, top_k=(pick["top_k"] or None),
                    top_p=float(pick["top_p"]) if sample else 1.0,
                    repetition_penalty=float(pick["repetition_penalty"]),
                    max_new_tokens=int(pick["max_new_tokens"])), source


def check_chat_template(tokenizer, checkpoint) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"{checkpoint} has no chat template; copy the original model's tokenizer_config.json or "
                         "chat_template.jinja into it (fusedkv convert keeps it), or use `fusedkv generate --prompt`")


def stop_ids(model, tokenizer, checkpoint) -> list[int]:
    """Every id that ends a turn: the config's and generation_config.json's eos_token_id (an id or a list),
    the tokenizer's eos token, and the END_OF_TURN tokens the vocabulary has."""
    ids = []
    for value in (model.config.eos_token_id, tokenizer.eos_token_id, _generation_eos(checkpoint)):
        ids += value if isinstance(value, list) else [] if value is None else [value]
    vocab = tokenizer.get_vocab()
    ids += [vocab[t] for t in END_OF_TURN if t in vocab]
    return sorted({i for i in ids if 0 <= i < model.config.vocab_size})


def _generation_eos(checkpoint):
    path = Path(checkpoint) / "generation_config.json"
    try:
        return json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    except (OSError, ValueError):
        return None  # sampling_settings reports an unreadable file


class TextStream:
    """Token ids in, complete text out, as it grows: a token may end inside a UTF-8 character (byte-level
    BPE), and a tokenizer may decode a token differently once the next is known (SentencePiece's spaces), so
    the text is decoded over a short window and only its new, complete part is given out (the offsets
    scheme of Hugging Face's text-generation-inference)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read] decode to text already given out
        self.given = 0  # characters given out

    def push(self, token: int) -> str:
        self.ids.append(token)
        decode = self.tokenizer.decode
        done = decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        text = decode(self.ids[self.prefix:], skip_special_tokens=True)
        if len(text) <= len(done) or text.endswith("\ufffd"):  # nothing new, or a character not yet complete
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        self.given += len(text) - len(done)
        return text[len(done):]

    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def flush(self) -> str:
        """What the whole answer decodes to beyond the text given out (a character the last tokens left open)."""
        rest = self.text()[self.given:]
        self.given += len(rest)
        return rest


@dataclass
class Turn:
    text: str  # the answer as printed
    new_tokens: int
    prefilled: int  # prompt tokens run through the model this turn
    reused: int  # prompt tokens whose K/V came from the previous turns' cache
    dropped: int  # exchanges dropped from the history to fit the context
    seconds: float
    interrupted: bool = False


class ChatSession:
    """A conversation with one model: `reply(text, write)` answers a user message, calling `write` with each
    new piece of text; `reset()` forgets the history (the system prompt stays)."""

    def __init__(self, model, tokenizer, sampling: Sampling, stops: list[int], system: str | None = None,
                 kv_dtype: torch.dtype | None = None, generator: torch.Generator | None = None):
        self.model, self.tokenizer, self.sampling, self.stops = model, tokenizer, sampling, stops
        self.system = system
        self.context = model.config.max_position_embeddings
        self.kv_dtype = kv_dtype or next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.generator = generator
        self.exchanges: list[tuple[str, str]] = []  # (user, assistant)
        self.cache: StaticKVCache | None = None
        self.cached: list[int] = []  # the ids whose K/V the cache holds

    def reset(self) -> None:
        self.exchanges.clear()
        self.cached = []  # the cache's memory is kept for the next turn

    def messages(self, user: str) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        past = [{"role": r, "content": c} for u, a in self.exchanges for r, c in (("user", u), ("assistant", a))]
        return system + past + [{"role": "user", "content": user}]

    def prompt_ids(self, user: str) -> tuple[list[int], int, int]:
        """The template's ids for the history plus `user`, the tokens left for the answer, and how many of the
        oldest exchanges had to be dropped (from `self.exchanges` too) to leave room for it."""
        dropped = 0
        while True:
            ids = self.tokenizer.apply_chat_template(self.messages(user), add_generation_prompt=True,
                                                     tokenize=True, return_dict=True)["input_ids"]
            room = self.context - len(ids)
            if room >= self.sampling.max_new_tokens or not self.exchanges:
                break
            self.exchanges.pop(0)
            dropped += 1
        if room < 1:
            raise UsageError(f"the message makes a prompt of {len(ids)} tokens but the model's context is "
                             f"{self.context}; send a shorter one (or /reset)")
        return ids, min(room, self.sampling.max_new_tokens), dropped

    def _cache_for(self, ids: list[int], new: int) -> StaticKVCache:
        """The kept cache, continuing from what it holds when that is a prefix of `ids`, else emptied to be
        prefilled again (see the module docstring: one forward over the history, rare next to reusing it); a
        larger one when it has no room for `ids` and `new` more."""
        c, n, need = self.cache, len(self.cached), len(ids) + new
        if c is not None and need <= c.max_len:
            if not (n == c.get_seq_length() and n < len(ids) and ids[:n] == self.cached):
                c.reset()
                self.cached = []
            return c
        size = max(need, 2 * c.max_len if c is not None else 0)
        size = min(self.context, -(-size // CACHE_BLOCK) * CACHE_BLOCK)
        self.cache, self.cached = StaticKVCache(self.model.config, 1, size, self.kv_dtype, self.device), []
        return self.cache

    def reply(self, user: str, write=lambda text: None, on_drop=lambda n: None) -> Turn:
        """Answer `user`; the answer's text goes to `write` piece by piece as it is sampled (`on_drop(n)` first
        when n old exchanges had to go). A KeyboardInterrupt (Ctrl-C) during generation ends the answer there:
        it is kept in the history as far as it got."""
        ids, new, dropped = self.prompt_ids(user)
        if dropped:
            on_drop(dropped)
        cache = self._cache_for(ids, new)
        reused = len(self.cached)
        stream, stops = TextStream(self.tokenizer), set(self.stops)
        answer: list[int] = []

        def on_token(token: torch.Tensor) -> None:
            t = int(token[0, 0])
            if t in stops:
                return
            answer.append(t)
            piece = stream.push(t)
            if piece:
                write(piece)

        interrupted = False
        s = self.sampling
        try:
            result = generate(self.model, torch.tensor([ids], device=self.device), new, temperature=s.temperature,
                              top_k=s.top_k, top_p=s.top_p, repetition_penalty=s.repetition_penalty,
                              eos_token_id=self.stops or None, generator=self.generator, weight_layout="auto",
                              cache=cache, on_token=on_token)
            seconds = result.ttft_s + sum(result.step_s)
            # The cache now holds every token but the last sampled (an end of turn, or the last of max_new_tokens).
            self.cached = result.tokens[0, :cache.get_seq_length()].tolist()
        except KeyboardInterrupt:
            interrupted, seconds = True, float("nan")
            self.cached = []  # stopped inside a forward, some layers may have written: the next turn empties it
        rest = stream.flush()
        if rest:
            write(rest)
        text = stream.text()
        self.exchanges.append((user, text))
        return Turn(text, len(answer), len(ids) - reused, reused, dropped, seconds, interrupted)
