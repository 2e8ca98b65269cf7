"""The synthetic retrieval generators (MQAR, passkey, RULER-style documents) and the training mixture."""

from __future__ import annotations

import hashlib
import random
import re

import numpy as np
import pytest

from fusedkv.data import BuiltinSource, prepare_dataset, resolve_source
from fusedkv.data.ruler_tasks import generate_task
from fusedkv.data.synthetic import (
    PASSKEY_QUESTION,
    MixtureSource,
    mqar_sample,
    passkey_sample,
    repeat_sample,
    ruler_sample,
    training_sample,
    versioned_spec,
)

WORDS = ("And the LORD spake unto Moses saying speak unto the children of Israel " * 40).split()


def _pairs(text: str) -> dict[str, str]:
    block = text.split("\n")[0].removeprefix("Pairs: ").rstrip(".")
    return dict(item.split(" ") for item in block.split(", "))


def test_mqar_answers_are_the_values_of_the_queried_keys():
    s = mqar_sample(random.Random(3), num_pairs=7, filler=WORDS[:30])
    pairs = _pairs(s.text)
    assert len(pairs) == 7 == len(s.answers) == s.num_pairs
    queries = s.text.split("Recall:")[1]
    asked = [q.split()[0] for q in queries.strip(" .\n").split(", ")]
    assert sorted(asked) == sorted(pairs)  # every key asked once, in a shuffled order
    assert s.answer_strings() == [pairs[k] for k in asked]
    assert " ".join(WORDS[:30]) in s.text  # the gap sits between pairs and queries
    assert s.text.index("Pairs:") < s.text.index(WORDS[0]) < s.text.index("Recall:")


def _recall(text: str) -> str:
    return text.split("Recall:", 1)[1]


@pytest.mark.parametrize("pairs", [1, 2, 8, 16, 40])
def test_mqar_keys_and_values_are_distinct_and_the_text_shows_no_answer(pairs):
    """Zoology's MQAR: distinct keys, distinct values; the input at each answer position is a random value
    that is none of the sample's values, so the text after the pairs shows no answer at all."""
    for seed in range(30):
        s = mqar_sample(random.Random(seed), pairs, WORDS[:seed])
        kv = _pairs(s.text)
        assert len(kv) == pairs and len(set(kv.values())) == pairs  # keys (dict) and values distinct
        assert s.golds is not None and len(s.golds) == len(s.answers) == pairs
        asked = [q.split()[0] for q in _recall(s.text).strip(" .\n").split(", ")]
        assert s.golds == [kv[k] for k in asked]
        shown = [s.text[a:b] for a, b in s.answers]  # the distractors in the answer slots
        assert all(len(d) == len(g) and d not in kv.values() for d, g in zip(shown, s.golds))
        assert not set(re.findall(r"\d+", _recall(s.text))) & set(kv.values())


def test_mqar_scores_each_query_on_its_own_prompt_with_no_earlier_answer_visible():
    s = mqar_sample(random.Random(11), 6, WORDS[:20])
    kv = _pairs(s.text)
    prompts = s.scored()
    assert len(prompts) == 6
    for j, (p, gold) in enumerate(zip(prompts, s.golds)):
        (a, b), = p.answers
        assert p.text[a:b] == gold == p.answer_strings()[0] and p.text.endswith(gold) and p.golds is None
        assert p.text[:a] == s.text[:a]  # the sample's own text up to this query: earlier slots hold distractors
        before = _recall(p.text[:a])
        assert before.count(", ") == j and not set(re.findall(r"\d+", before)) & set(kv.values())
    # Samples whose answers stand in their text are scored as they are.
    pk = passkey_sample(random.Random(0), WORDS[:50])
    assert pk.scored() == [pk]


def test_mqar_training_documents_score_one_query_with_no_earlier_answer_visible():
    rng = random.Random(4)
    docs = [training_sample(rng, WORDS, 40, 0, i, tasks=("mqar",)) for i in range(200)]
    seen_earlier = 0
    for d in docs:
        kv = _pairs(d.text)
        assert len(set(kv.values())) == len(kv) == d.num_pairs
        (a, b), = d.answers  # one target per document: the last query shown
        key = d.text[:a].split()[-1]
        assert d.text[a:b] == kv[key] and d.text[b:] == ".\n"
        before = _recall(d.text[:a])
        assert not set(re.findall(r"\d+", before)) & set(kv.values())
        seen_earlier += before.count(",")
    assert seen_earlier > 100  # most documents show earlier queries (with distractors) before the scored one


def test_mqar_is_deterministic_and_checks_its_arguments():
    assert mqar_sample(random.Random(1), 5).text == mqar_sample(random.Random(1), 5).text
    assert mqar_sample(random.Random(1), 5).text != mqar_sample(random.Random(2), 5).text
    assert len(mqar_sample(random.Random(0), 6, num_queries=2).answers) == 2
    with pytest.raises(ValueError, match="num_pairs"):
        mqar_sample(random.Random(0), 0)
    with pytest.raises(ValueError, match="num_queries"):
        mqar_sample(random.Random(0), 3, num_queries=4)


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_passkey_hides_the_key_at_the_depth_and_asks_for_it(depth):
    s = passkey_sample(random.Random(7), WORDS[:100], depth=depth)
    (key,) = s.answer_strings()
    assert len(key) == 5 and key.isdigit()
    needle = s.text.index(f"The pass key is {key}.")
    before = len(s.text[:needle].split())
    assert before == round(depth * 100)
    assert s.text[: s.answers[0][0]].endswith(PASSKEY_QUESTION + " ")
    assert s.text.count(key) == 3  # twice in the needle, once as the answer


def test_ruler_documents_reuse_the_ruler_generator():
    s = ruler_sample("niah_single_2", 200, seed=0, index=4, haystack_text=" ".join(WORDS))
    from fusedkv.data.synthetic import _WhitespaceTokenizer

    ref = generate_task("niah_single_2", _WhitespaceTokenizer(), 200, 1, seed=4, haystack_text=" ".join(WORDS))[0]
    assert s.text.startswith(ref.input)
    assert s.answer_strings() == ref.outputs


def test_training_samples_cover_every_task_with_consistent_answers():
    rng = random.Random(0)
    samples = [training_sample(rng, WORDS, 80, 0, i) for i in range(60)]
    kinds = {s.task if s.task in ("mqar", "passkey") else "ruler" for s in samples}
    assert kinds == {"mqar", "passkey", "ruler"}
    for s in samples:
        assert s.answers and all(a.strip() for a in s.answer_strings())
        assert all(s.text[a - 1] in " :,\n" for a, _ in s.answers)  # an answer starts a new word


def test_repeat_answers_are_the_second_copy_word_by_word():
    s = repeat_sample(random.Random(5), 9)
    first, second = s.text.split("\n")[:2]
    words = first.removeprefix("Repeat: ").rstrip(".").split()
    assert len(words) == 9 and second == "Again: " + " ".join(words) + "."
    assert s.answer_strings() == words[1:]  # the first word of the copy is not predictable, the rest are
    assert all(s.text[a - 1] == " " for a, _ in s.answers)
    with pytest.raises(ValueError, match="at least 2"):
        repeat_sample(random.Random(0), 1)


def test_training_samples_draw_only_the_chosen_tasks():
    rng = random.Random(1)
    kinds = [training_sample(rng, WORDS, 80, 0, i, tasks=("mqar", "repeat")).task for i in range(200)]
    assert set(kinds) == {"mqar", "repeat"} and 70 < kinds.count("repeat") < 130  # equal shares
    # The default draw is pinned, document for document, so a cached mixture (same spec, same fingerprint)
    # holds the documents a new preparation would write. The digest changed once, with MQAR format 2, and
    # the spec with it (":mqar=2"): datasets of format 1 are never reused.
    rng = random.Random(2)
    texts = "\x00".join(training_sample(rng, WORDS, 80, 0, i).text for i in range(40))
    assert hashlib.sha256(texts.encode()).hexdigest()[:16] == "357699556d012c60"


def test_mixture_spec_parsing():
    src = resolve_source("mix:builtin:0.25:words=64:seed=3")
    assert isinstance(src, MixtureSource)
    assert (src.fraction, src.words, src.seed) == (0.25, 64, 3)
    assert src.spec == "mix:builtin:0.25:words=64:seed=3:mqar=2"  # the MQAR format is part of the data
    dense = resolve_source("mix:builtin:0.75:tasks=mqar+repeat")
    assert dense.tasks == ("mqar", "repeat") and dense.spec.endswith(":tasks=mqar+repeat:mqar=2")
    assert resolve_source("mix:builtin:0.75:tasks=repeat:mqar=2").spec.endswith(":tasks=repeat")
    explicit = resolve_source("mix:builtin:0.75:tasks=mqar:mqar=2")
    assert explicit.spec == resolve_source("mix:builtin:0.75:tasks=mqar").spec
    for bad, msg in [("mix:builtin:1.5", "in \\(0, 1\\)"), ("mix:other:0.2", "built-in corpus"),
                     ("mix:builtin:x", "mix:builtin:FRACTION"), ("mix:builtin:0.2:size=3", "unknown option"),
                     ("mix:builtin:0.2:tasks=mqar+haystack", "tasks=mqar\\+repeat"),
                     ("mix:builtin:0.2:tasks=mqar+mqar", "at most once"), ("mix:builtin:0.2:mqar=1", "withdrawn")]:
        with pytest.raises(ValueError, match=msg):
            resolve_source(bad)


class _SmallMixture(MixtureSource):
    """The mixture over a few real corpus documents instead of the whole corpus (seconds, not minutes);
    one of them carries a held-out work's name."""

    def __init__(self, docs, fraction, **kw):
        super().__init__(fraction, words=40, **kw)
        self.docs = docs

    def _base_docs(self):
        return iter(self.docs)


def test_mixture_share_split_and_shards(tmp_path, small_text):
    n = 12
    size = len(small_text) // n
    docs = [(f"shakespeare/part{i}", small_text[i * size:(i + 1) * size]) for i in range(n - 1)]
    docs.append(("kjv/Ruth", small_text[(n - 1) * size:]))  # a held-out name: validation only
    src = _SmallMixture(docs, fraction=0.3)
    named = list(src.iter_named())
    synth = [t for name, t in named if name.startswith("synthetic/")]
    natural = sum(len(t) for name, t in docs if name != "kjv/Ruth")
    share = sum(map(len, synth)) / (sum(map(len, synth)) + natural)
    assert 0.3 <= share < 0.3 + 0.01  # stops at the first document past the target
    assert [d for d in named if not d[0].startswith("synthetic/")] == docs  # the corpus itself is unchanged
    assert named[1][0].startswith("synthetic/")  # interleaved, not appended
    assert named == list(src.iter_named())  # deterministic
    ruth = docs[-1][1].split()
    assert not any(" ".join(ruth[i:i + 8]) in t for t in synth for i in range(0, len(ruth) - 8, 500))
    # The full mixture is a BuiltinSource, so prepare_dataset holds out BUILTIN_VAL_DOCS; this small one
    # holds one of them.
    assert isinstance(src, BuiltinSource)
    ds = prepare_dataset(src, tmp_path / "mix", vocab_size=400, num_proc=1, val_docs=["kjv/Ruth"])
    assert ds.meta["val"]["num_documents"] == 1  # only the held-out work, no synthetic document
    assert ds.meta["train"]["num_documents"] == len(named) - 1


def test_answers_only_loss_marks_exactly_the_answer_tokens(tmp_path, small_text):
    docs = [("shakespeare/a", small_text[:20_000]), ("kjv/Ruth", small_text[20_000:30_000])]
    src = _SmallMixture(docs, fraction=0.5, tasks=("mqar", "repeat"), loss="answers")
    assert src.spec.endswith(":tasks=mqar+repeat:loss=answers:mqar=2") and src.has_targets
    named = list(src.iter_named())
    ds = prepare_dataset(src, tmp_path / "mix", vocab_size=600, num_proc=2, val_docs=["kjv/Ruth"])
    tok = ds.load_tokenizer()
    tokens, targets = np.asarray(ds.train.tokens), np.asarray(ds.train.targets)
    ends = np.flatnonzero(tokens == ds.eos_id)  # one EOS after each training document, in order
    train_docs = [t for n, t in named if n != "kjv/Ruth"]
    assert len(ends) == len(train_docs)
    starts = np.concatenate([[0], ends[:-1] + 1])
    for text, a, b in zip(train_docs, starts, ends):
        mask = targets[a:b].astype(bool)
        if not hasattr(text, "target_spans"):
            assert mask.all()  # corpus text counts in full
            continue
        # The target tokens decode to the answers, one after another, and nothing else; the EOS counts.
        answers = "".join(text[x:y] for x, y in text.target_spans)
        assert tok.decode(tokens[a:b][mask].tolist()).replace(" ", "") == answers.replace(" ", "")
        assert targets[b] == 1
    assert ds.val.targets is not None and np.asarray(ds.val.targets).all()  # the held-out work counts in full


def test_versioned_spec_names_the_mqar_format_so_cached_runs_of_format_1_are_not_reused():
    old = "mix:builtin:0.9:words=40:tasks=mqar+repeat:loss=answers"  # retrieval.yaml's spec of format 1
    assert versioned_spec(old) == old + ":mqar=2" != old
    assert versioned_spec(old + ":mqar=2") == old + ":mqar=2"
    assert versioned_spec("mix:builtin:0.25") == "mix:builtin:0.25:mqar=2"  # the default tasks hold MQAR
    for same in ["mix:builtin:0.5:tasks=repeat+passkey", "builtin", "/data/file.txt", None]:
        assert versioned_spec(same) == same
