"""`fusedkv.chat`: the template's ids, greedy answers equal to transformers' generate on the same ids (also
from a cache kept across turns), streaming, `/reset`, history kept within the context, Ctrl-C during an
answer, and the sampling settings a checkpoint's generation_config.json gives."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from fusedkv import FusedKVForCausalLM
from fusedkv.cache import StaticKVCache
from fusedkv.chat import ChatSession, Sampling, TextStream, check_chat_template, sampling_settings, stop_ids
from fusedkv.errors import UsageError
from fusedkv.generation import generate


def load(ckpt):
    return FusedKVForCausalLM.from_pretrained(ckpt).eval(), AutoTokenizer.from_pretrained(ckpt)


def session(ckpt, max_new_tokens=6, penalty=1.0, system="Be brief."):
    model, tok = load(ckpt)
    sampling = Sampling(temperature=0.0, top_k=None, top_p=1.0, repetition_penalty=penalty,
                        max_new_tokens=max_new_tokens)
    return ChatSession(model, tok, sampling, stop_ids(model, tok, ckpt), system=system)


def template_ids(tok, messages):
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]


def reference(model, ids, n, penalty):
    """transformers' own greedy generate on the same ids (from scratch, its own cache)."""
    prompt = torch.tensor([ids])
    with torch.no_grad():  # an explicit mask: no token of the prompt is taken for padding
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False,
                             repetition_penalty=penalty, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_greedy_turns_equal_transformers_generate_on_the_template_ids(chat_ckpt, penalty):
    s = session(chat_ckpt, penalty=penalty)
    model, tok = s.model, s.tokenizer
    history = [{"role": "system", "content": "Be brief."}]
    answers = []
    for k, user in enumerate(["hello there", "and the fox?", "what next"]):
        ids = template_ids(tok, [*history, {"role": "user", "content": user}])
        before = list(s.cached)
        turn = s.reply(user)
        ref = reference(model, ids, 6, penalty)
        assert s.cached == ids + ref[:-1]  # the template's ids were fed, then the answer (all but its last token)
        assert turn.text == tok.decode(ref) and turn.new_tokens == 6
        if k:  # the earlier turns' K/V were reused: only the new part of the prompt was prefilled
            assert turn.reused == len(before) > 0 and turn.prefilled == len(ids) - len(before)
            assert ids[:len(before)] == before
        history += [{"role": "user", "content": user}, {"role": "assistant", "content": turn.text}]
        answers.append(turn.text)
    if penalty != 1.0:  # the penalty did change something (else this case would test nothing more than the first)
        plain = session(chat_ckpt)
        assert [plain.reply(u).text for u in ["hello there", "and the fox?", "what next"]] != answers


def test_generate_from_a_cache_holding_the_prefix_equals_from_scratch(chat_ckpt):
    model, _ = load(chat_ckpt)
    ids = torch.randint(2, 250, (1, 30), generator=torch.Generator().manual_seed(0))
    cache = StaticKVCache(model.config, 1, 64)
    first = generate(model, ids[:, :20], 3, cache=cache)
    assert cache.get_seq_length() == 22  # the prompt and the new tokens but the last
    for more in (ids[:, 20:30], ids[:, 29:30]):  # a chunk prefilled on top of the cache, then a single token
        prompt = torch.cat([first.tokens[:, :cache.get_seq_length()], more], dim=1)
        first = generate(model, prompt, 5, cache=cache)
        assert torch.equal(first.tokens, generate(model, prompt, 5).tokens)
    with pytest.raises(ValueError, match="cache holds"):
        generate(model, ids[:, :10], 2, cache=cache)  # the cache holds more than this prompt


def test_answers_stream_token_by_token(chat_ckpt):
    s = session(chat_ckpt, max_new_tokens=8)
    seen = []  # how many tokens the cache held each time text came out
    turn = s.reply("hello there", write=lambda piece: seen.append((piece, s.cache.get_seq_length())))
    assert "".join(p for p, _ in seen) == turn.text
    lengths = [n for _, n in seen]
    assert len(seen) == 8 and lengths == sorted(set(lengths))  # one piece per token, while generating
    assert lengths[0] < lengths[-1]


def test_text_stream_gives_only_complete_characters(chat_ckpt):
    _, tok = load(chat_ckpt)
    text = "héllo wörld ✓ naïve 漢字"
    ids = tok(text, add_special_tokens=False).input_ids
    stream = TextStream(tok)
    pieces = [stream.push(t) for t in ids]
    assert len(ids) > len(text.split()) and not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) + stream.flush() == text


def test_reset_forgets_the_history_and_keeps_the_system_prompt(chat_ckpt):
    s = session(chat_ckpt)
    tok = s.tokenizer
    s.reply("hello there")
    s.reply("and the fox?")
    s.reset()
    turn = s.reply("what next")
    ids = template_ids(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "what next"}])
    assert s.cached[:len(ids)] == ids and turn.reused == 0
    prompt = tok.decode(s.cached[:len(ids)])
    assert "hello there" not in prompt and "fox" not in prompt and "Be brief." in prompt


def test_history_is_cut_to_the_context_oldest_first(chat_ckpt):
    s = session(chat_ckpt, max_new_tokens=10)
    tok = s.tokenizer
    drops = []
    message = "the lazy dog sleeps by the warm door"  # ~ 20 tokens with the template's, a turn ~ 30
    for k in range(8):
        turn = s.reply(f"{message} {k}", on_drop=drops.append)
        assert len(s.cached) + 1 <= s.context  # prompt + answer fit
        first_user = s.messages("x")[1]["content"]
        assert first_user.endswith(str(k - len(s.exchanges) + 1)) or k == 0
    assert drops and sum(drops) == 8 - len(s.exchanges)
    assert turn.dropped == drops[-1] or turn.dropped == 0
    kept = tok.decode(s.cached)
    assert kept.startswith("<|im_start|>system\nBe brief.") and f"{message} 0" not in kept
    with pytest.raises(UsageError, match="context is 128"):
        s.reply("dog " * 200)


def test_ctrl_c_stops_the_answer_not_the_session(chat_ckpt):
    s = session(chat_ckpt, max_new_tokens=8)
    written = []

    def write(piece):
        if len(written) == 3:
            raise KeyboardInterrupt
        written.append(piece)

    turn = s.reply("hello there", write=write)
    assert turn.interrupted and s.cached == [] and turn.text.startswith("".join(written))
    assert s.exchanges == [("hello there", turn.text)]
    ids = template_ids(s.tokenizer, s.messages("and the fox?"))
    after = s.reply("and the fox?")  # the history prefilled again into a fresh cache
    assert not after.interrupted and after.reused == 0
    assert after.text == s.tokenizer.decode(reference(s.model, ids, 8, 1.0))


def test_sampling_follows_generation_config_then_flags(chat_ckpt, tmp_path):
    sampling, source = sampling_settings(tmp_path)  # no generation_config.json
    assert sampling.temperature == 0.7 and sampling.top_p == 0.9 and "defaults" in source
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.2, "top_p": 0.8, "repetition_penalty": 1.1, "eos_token_id": [5, 7]}))
    sampling, source = sampling_settings(tmp_path)
    assert (sampling.temperature, sampling.top_p, sampling.repetition_penalty) == (0.2, 0.8, 1.1)
    assert "temperature" in source
    assert sampling_settings(tmp_path, temperature=0.5, top_p=0.95)[0].temperature == 0.5
    assert sampling_settings(tmp_path, greedy=True)[0].temperature == 0.0
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert sampling_settings(tmp_path)[0].temperature == 0.0  # its author asked for greedy
    model, tok = load(chat_ckpt)
    assert tok.convert_tokens_to_ids("<|im_end|>") in stop_ids(model, tok, chat_ckpt)


def test_a_tokenizer_without_a_template_is_one_clear_error(chat_ckpt):
    _, tok = load(chat_ckpt)
    tok.chat_template = None
    with pytest.raises(UsageError, match="no chat template; copy the original model's"):
        check_chat_template(tok, chat_ckpt)
