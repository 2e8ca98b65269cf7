"""Retrieval evaluation: sample lengths, answer-token bookkeeping, teacher-forced scoring == greedy decoding."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from fusedkv import FusedKVConfig, FusedKVForCausalLM
from fusedkv.data.synthetic import mqar_sample
from fusedkv.eval.retrieval import (
    encode_with_answers,
    format_retrieval,
    mqar_samples,
    passkey_samples,
    plot_retrieval,
    run_retrieval,
    score_samples,
)
from fusedkv.generation import generate


@pytest.fixture(scope="module")
def words(corpus_text):
    return corpus_text.split()


@pytest.fixture(scope="module")
def fkv_model(tokenizer):
    torch.manual_seed(0)
    cfg = FusedKVConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, max_position_embeddings=512, kv_sharing="fusedkv")
    return FusedKVForCausalLM(cfg).eval()


def _ntok(tokenizer, text):
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("length", [96, 200])
def test_mqar_samples_fill_the_length(tokenizer, words, length):
    samples = mqar_samples(tokenizer, 4, length, 3, seed=1, words=words)
    for s in samples:
        n = _ntok(tokenizer, s.text)
        assert length - 12 <= n <= length  # the largest gap that fits
        assert len(s.answers) == 4
    assert [s.text for s in samples] == [s.text for s in mqar_samples(tokenizer, 4, length, 3, seed=1, words=words)]
    with pytest.raises(ValueError, match="too short"):
        mqar_samples(tokenizer, 32, 40, 1, words=words)


def test_passkey_samples_fill_the_length(tokenizer, words):
    for s in passkey_samples(tokenizer, 150, 4, words=words):
        assert 150 - 12 <= _ntok(tokenizer, s.text) <= 150


def test_answer_tokens_spell_the_answer(tokenizer, words):
    s = mqar_sample(random.Random(0), 5, words[:20])
    ids, spans = encode_with_answers(tokenizer, s)
    for span, answer in zip(spans, s.answer_strings()):
        assert span == list(range(span[0], span[-1] + 1))
        assert tokenizer.decode(ids[span[0]: span[-1] + 1]).strip() == answer


class _Oracle(torch.nn.Module):
    """Predicts the next token of its own input (it reads ahead), except where told to be wrong: what a
    perfect model would score, with known mistakes."""

    def __init__(self, vocab, wrong=()):
        super().__init__()
        self.config = SimpleNamespace(max_position_embeddings=10_000)
        self.vocab, self.wrong = vocab, set(wrong)
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, use_cache=False):
        nxt = torch.roll(input_ids, -1, dims=1)
        for r, t in self.wrong:
            nxt[r, t] = (nxt[r, t] + 1) % self.vocab
        return SimpleNamespace(logits=torch.nn.functional.one_hot(nxt, self.vocab).float())


def test_score_counts_answers_and_samples(tokenizer, words):
    samples = [mqar_sample(random.Random(i), 4, words[: 10 * i]) for i in range(3)]
    # Batches of 2: rows of different lengths, right-padded.
    assert score_samples(_Oracle(len(tokenizer)), tokenizer, samples, batch_size=2)["accuracy"] == 100.0
    # One wrong token inside sample 1's second answer: 11 of 12 answers, 2 of 3 samples right.
    _, spans = encode_with_answers(tokenizer, samples[1])
    oracle = _Oracle(len(tokenizer), wrong=[(1, spans[1][-1] - 1)])
    r = score_samples(oracle, tokenizer, samples, batch_size=3)
    assert r["accuracy"] == pytest.approx(100 * 11 / 12) and r["sample_accuracy"] == pytest.approx(100 * 2 / 3)
    # A wrong prediction outside every answer does not count.
    r = score_samples(_Oracle(len(tokenizer), wrong=[(0, 1)]), tokenizer, samples)
    assert r["accuracy"] == 100.0


@pytest.mark.slow
def test_teacher_forced_score_equals_greedy_generation(tokenizer, words, fkv_model):
    """Each answer is scored right exactly when fusedkv.generation.generate, started from the gold text
    before it, produces the answer's tokens (the model under test: FusedKV, random weights)."""
    samples = passkey_samples(tokenizer, 120, 6, words=words) + mqar_samples(tokenizer, 3, 100, 2, words=words)
    agree = 0
    for s in samples:
        ids, spans = encode_with_answers(tokenizer, s)
        with torch.no_grad():
            pred = fkv_model(input_ids=torch.tensor([ids])).logits.argmax(-1)[0]
        for span in spans:
            out = generate(fkv_model, torch.tensor([ids[: span[0]]]), max_new_tokens=len(span)).tokens[0, span[0]:]
            assert int(out[0]) == int(pred[span[0] - 1])  # the first answer token, both ways
            forced = all(int(pred[t - 1]) == ids[t] for t in span)
            greedy = out.tolist() == ids[span[0]: span[-1] + 1]
            assert forced == greedy
            agree += 1
    assert agree == 6 + 2 * 3
    # And score_samples says what those per-answer checks say.
    r = score_samples(fkv_model, tokenizer, samples, batch_size=3)
    assert r["answers"] == 12


def test_run_retrieval_grid_table_and_plot(tokenizer, words, fkv_model, tmp_path):
    # With this 400-token BPE, 2 pairs take ~50 tokens, 8 pairs ~150 and a passkey question ~60.
    r = run_retrieval(fkv_model, tokenizer, lengths=[40, 96, 200], pairs=[2, 8], num_samples=2)
    assert r["mqar"][8][96] is None and r["passkey"][40] is None  # do not fit: 8 pairs in 96, a passkey in 40
    assert all(0 <= r["mqar"][p][L] <= 100 for p, L in [(2, 96), (2, 200), (8, 200)])
    assert 0 <= r["passkey"][200] <= 100
    table = format_retrieval(r)
    assert "| MQAR 8 pairs | - | - |" in table and "| passkey | - |" in table
    png = plot_retrieval({"random fusedkv": r}, tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 1000 and png.endswith("r.png")


def test_too_long_for_the_model_is_refused(tokenizer, words, fkv_model):
    samples = passkey_samples(tokenizer, 600, 1, words=words)
    with pytest.raises(ValueError, match="model context 512"):
        score_samples(fkv_model, tokenizer, samples)


def test_eval_command_retrieval(tmp_path, tokenizer, tokenizer_dir, corpus_text, fkv_model, capsys):
    from fusedkv.cli import main
    from fusedkv.data import prepare_dataset

    ckpt = tmp_path / "ckpt"
    fkv_model.save_pretrained(ckpt)
    tokenizer.save_pretrained(ckpt)
    (tmp_path / "val.txt").write_text(corpus_text)
    val = prepare_dataset(str(tmp_path / "val.txt"), tmp_path / "val", tokenizer=str(tokenizer_dir), num_proc=1)
    args = ["eval", str(ckpt), "--val", str(val.out_dir), "--seq-len", "64", "--max-batches", "1", "--tasks", "none",
            "--retrieval",
            "--retrieval-lengths", "96,200", "--retrieval-pairs", "2", "--retrieval-samples", "2",
            "--retrieval-plot", str(tmp_path / "r.png"), "--json", str(tmp_path / "r.json")]
    assert main(args) == 0
    assert "| MQAR 2 pairs |" in capsys.readouterr().out and (tmp_path / "r.png").is_file()
    import json

    assert set(json.loads((tmp_path / "r.json").read_text())["retrieval"]["passkey"]) == {"96", "200"}
    assert main(args[:-4] + ["--retrieval-lengths", "1024"]) == 2  # past the 512-token context: refused
