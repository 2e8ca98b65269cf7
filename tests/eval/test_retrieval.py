"""Retrieval evaluation: sample lengths, answer-token bookkeeping, teacher-forced scoring == greedy decoding."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fusedkv import FusedKVConfig, FusedKVForCausalLM
from fusedkv.data.synthetic import TextSample, mqar_sample
from fusedkv.eval.retrieval import (
    above_floor,
    binomial_sf,
    encode_with_answers,
    format_retrieval,
    mqar_samples,
    passkey_samples,
    plot_retrieval,
    random_copy_floor,
    run_retrieval,
    score_samples,
    uniform_floor,
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
    for prompt, gold in zip(s.scored(), s.golds):
        ids, (span,) = encode_with_answers(tokenizer, prompt)
        assert span == list(range(span[0], len(ids)))  # the gold value ends its prompt
        assert tokenizer.decode(ids[span[0]:]).strip() == gold


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
    # One wrong token inside sample 1's second answer (prompt 4 + 1 of the 12, one batch): 11 of 12 answers,
    # 2 of 3 samples right.
    _, (span,) = encode_with_answers(tokenizer, samples[1].scored()[1])
    oracle = _Oracle(len(tokenizer), wrong=[(5, span[-1] - 1)])
    r = score_samples(oracle, tokenizer, samples, batch_size=12)
    assert r["accuracy"] == pytest.approx(100 * 11 / 12) and r["sample_accuracy"] == pytest.approx(100 * 2 / 3)
    assert (r["answers"], r["samples"]) == (12, 3)
    # A wrong prediction outside every answer does not count.
    r = score_samples(_Oracle(len(tokenizer), wrong=[(0, 1)]), tokenizer, samples)
    assert r["accuracy"] == 100.0


def _floors():
    """scripts/mqar_floors.py: the scripted predictors (loaded from the script, defined once there)."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "mqar_floors.py"
    spec = importlib.util.spec_from_file_location("mqar_floors", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("pairs", [2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
def test_scripted_predictors_through_the_scorer_prove_the_floors(tokenizer, words, pairs):
    """Through the real scorer (`run_retrieval`'s sampling and `score_samples`): perfect lookup scores 100,
    copying a random value of the pair list ~1/P, answering by elimination no better than that (no earlier
    answer is visible to eliminate), a uniform guess ~1/90; only lookup is above the random-copy floor.
    On the withdrawn format (each earlier gold answer in the text) the same eliminator beats 1/P: the test
    can tell the two formats apart."""
    floors = _floors()
    samples = mqar_samples(tokenizer, pairs, 200, 40, seed=pairs, words=words)
    multi = [len(encode_with_answers(tokenizer, p)[1][0]) > 1 for s in samples for p in s.scored()]
    assert any(multi)  # values of several tokens are scored too (this BPE splits some two-digit numbers)
    acc = {name: score_samples(floors.ScriptedMQAR(tokenizer, name), tokenizer, samples, batch_size=16)["accuracy"]
           for name in floors.STRATEGIES}
    floor = random_copy_floor(pairs)
    assert acc["lookup"] == 100.0
    assert abs(acc["copy"] - floor) < 10 and abs(acc["eliminate"] - floor) < 10
    assert acc["eliminate"] <= acc["copy"] + 8  # no better than copying at random
    assert acc["uniform"] <= 6
    n = 40
    assert above_floor(acc["lookup"], pairs, n) and not above_floor(acc["copy"], pairs, n)
    assert not above_floor(acc["eliminate"], pairs, n)
    # The withdrawn format: the same samples with every gold value in its slot, scored in one text.
    old = [TextSample("mqar", floors.with_golds(s), s.answers, pairs) for s in samples]
    eliminated = score_samples(floors.ScriptedMQAR(tokenizer, "eliminate"), tokenizer, old, batch_size=16)["accuracy"]
    expected = 100 * sum(1 / k for k in range(1, pairs + 1)) / pairs  # 1/P, 1/(P-1), ..., 1 over the queries
    assert abs(eliminated - expected) < 10 and eliminated > floor + 15


def test_floors_and_the_binomial_test():
    assert random_copy_floor(4) == 25.0 and uniform_floor() == pytest.approx(100 / 90)
    # P(X >= k), X ~ Binomial(n, p), against the sum of its terms
    from math import comb
    for k, n, p in [(3, 10, 0.5), (0, 5, 0.2), (7, 7, 0.3), (30, 100, 0.25)]:
        assert binomial_sf(k, n, p) == pytest.approx(sum(comb(n, i) * p**i * (1 - p) ** (n - i)
                                                         for i in range(k, n + 1)), rel=1e-9)
    # 50 samples x 2 pairs: 100 answers against 1/2; 59 right is p = 0.044, 58 right p = 0.067
    assert above_floor(59.0, 2, 50) and not above_floor(58.0, 2, 50)
    assert above_floor(None, 2, 50) is None


@pytest.mark.slow
def test_teacher_forced_score_equals_greedy_generation(tokenizer, words, fkv_model):
    """Each answer is scored right exactly when fusedkv.generation.generate, started from the gold text
    before it, produces the answer's tokens (the model under test: FusedKV, random weights)."""
    samples = passkey_samples(tokenizer, 120, 6, words=words) + mqar_samples(tokenizer, 3, 100, 2, words=words)
    agree = 0
    for prompt in (p for s in samples for p in s.scored()):
        ids, spans = encode_with_answers(tokenizer, prompt)
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


@pytest.mark.slow
def test_run_retrieval_grid_table_and_plot(tokenizer, words, fkv_model, tmp_path):
    # With this 400-token BPE, 2 pairs take ~50 tokens, 8 pairs ~150 and a passkey question ~60.
    r = run_retrieval(fkv_model, tokenizer, lengths=[40, 96, 200], pairs=[2, 8], num_samples=2)
    assert r["mqar"][8][96] is None and r["passkey"][40] is None  # do not fit: 8 pairs in 96, a passkey in 40
    assert all(0 <= r["mqar"][p][L] <= 100 for p, L in [(2, 96), (2, 200), (8, 200)])
    assert 0 <= r["passkey"][200] <= 100
    table = format_retrieval(r)
    assert "| MQAR 8 pairs | 12.5 | - | - |" in table and "| passkey | 0.0 | - |" in table  # floors beside
    assert "| MQAR 2 pairs | 50.0 |" in table and "uniform guess over the 90 values 1.1" in table
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
