"""RULER-style task generation and scoring: the prompts really contain what the gold answers claim."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from fusedkv.eval.ruler import (
    TASKS,
    format_table,
    generate_predictions,
    generate_task,
    run_ruler,
    score_task,
    string_match_all,
    string_match_part,
)

NEEDLE_RE = re.compile(r"One of the special magic (?:numbers|uuids) for (\S+) is: (\S+)\.")


def test_scorers_on_hand_made_examples():
    preds = ["The numbers are 123 and 456", "nothing here", "ABC"]
    refs = [["123", "456"], ["789"], ["abc", "def"]]
    assert string_match_all(preds, refs) == pytest.approx(50.0)  # (1 + 0 + 1/2) / 3
    assert string_match_part(preds, refs) == pytest.approx(200 / 3)  # (1 + 0 + 1) / 3
    assert string_match_all(["x"], [["X"]]) == 100.0  # case-insensitive
    assert string_match_all([], []) == 0.0
    with pytest.raises(ValueError):
        string_match_all(["a"], [])
    assert all(TASKS[t].metric == "all" for t in TASKS)  # QA (metric "part") is not implemented


# lengths at which each task fits with the tiny 400-token test BPE (a real tokenizer needs far fewer
# tokens per word, so all tasks fit at much shorter lengths there)
LENGTHS = {t: (256, 1024) for t in TASKS}
LENGTHS.update({"niah_multikey_3": (512, 1024), "niah_multiquery": (512, 1024), "vt": (512, 1024),
                "fwe": (512, 1024), "cwe": (1536, 2048)})


@pytest.mark.parametrize("task", sorted(TASKS))
def test_lengths_close_to_budget(task, tokenizer, corpus_text):
    for L in LENGTHS[task]:
        samples = generate_task(task, tokenizer, L, 2, seed=1, haystack_text=corpus_text)
        assert len(samples) == 2
        for s in samples:
            n = len(tokenizer(s.input)["input_ids"])
            assert s.length == n and s.max_length == L and s.task == task
            assert 0.8 * L <= n <= L, (task, L, n)
            assert s.outputs and all(o in s.input for o in s.outputs)
            # a prediction that repeats the gold answers scores 100
            assert score_task(task, [" ".join(s.outputs)], [s.outputs]) == 100.0
    again = generate_task(task, tokenizer, LENGTHS[task][0], 2, seed=1, haystack_text=corpus_text)
    first = generate_task(task, tokenizer, LENGTHS[task][0], 2, seed=1, haystack_text=corpus_text)
    assert [s.input for s in again] == [s.input for s in first]  # deterministic in the seed


def test_too_short_raises(tokenizer):
    with pytest.raises(ValueError, match="too short"):
        generate_task("niah_single_1", tokenizer, 20, 1)
    with pytest.raises(KeyError):
        generate_task("qa_1", tokenizer, 1024, 1)


@pytest.mark.parametrize("task,L", [("niah_single_1", 256), ("niah_single_1", 1024), ("niah_single_2", 256),
                                    ("niah_single_2", 1024), ("niah_single_3", 512), ("niah_single_3", 1024)])
def test_needle_at_requested_depth(task, L, tokenizer, corpus_text):
    # (a uuid is ~36 tokens with the tiny test BPE, so niah_single_3 at 256 leaves too little haystack
    # for a 10% depth resolution)
    for depth in (0.0, 0.3, 0.5, 0.8, 1.0):
        (s,) = generate_task(task, tokenizer, L, 1, seed=3, depth=depth, haystack_text=corpus_text)
        assert s.depth == depth
        (value,) = s.outputs
        needles = NEEDLE_RE.findall(s.input)
        assert len(needles) == 1 and needles[0][1] == value
        key = needles[0][0]
        assert f"for {key} mentioned in the provided text?" in s.input  # the question asks for that key
        start = s.input.index("afterwards.\n") + len("afterwards.\n")
        end = s.input.rindex("\nWhat is the special magic")
        pos = s.input.index("One of the special magic", start)
        needle_len = len(f"One of the special magic numbers for {key} is: {value}.")
        frac = (pos - start) / max(1, end - start - needle_len)
        assert abs(frac - depth) <= 0.1, (task, L, depth, frac)


@pytest.mark.parametrize("task", ["niah_multikey_1", "niah_multikey_2", "niah_multikey_3"])
def test_multikey_distractors(task, tokenizer, corpus_text):
    for s in generate_task(task, tokenizer, 1024, 2, seed=5, haystack_text=corpus_text):
        needles = NEEDLE_RE.findall(s.input)
        keys = [k for k, _ in needles]
        assert len(keys) == len(set(keys)), "distractor keys must be distinct"
        (value,) = s.outputs
        gold = [k for k, v in needles if v == value]
        assert len(gold) == 1
        assert f"for {gold[0]} mentioned in the provided text?" in s.input
        distractors = [(k, v) for k, v in needles if k != gold[0]]
        # multikey_1: 3 distractors in an essay; 2/3: the whole haystack is distractor needles (a uuid
        # needle is ~90 tokens with the tiny test BPE, so only ~8 fit in 1024 tokens)
        assert len(distractors) == 3 if task == "niah_multikey_1" else len(distractors) >= 6
        assert all(v != value for _, v in distractors)
        if task == "niah_multikey_1":
            assert len(needles) == 4
        if task == "niah_multikey_3":
            assert all(re.fullmatch(r"[0-9a-f-]{36}", x) for k, v in needles for x in (k, v))
        else:  # word keys adjective-noun, numeric values
            assert all(re.fullmatch(r"[a-z]+-[a-z]+", k) and re.fullmatch(r"\d{7}", v) for k, v in needles)


def test_multivalue_and_multiquery(tokenizer, corpus_text):
    (s,) = generate_task("niah_multivalue", tokenizer, 1024, 1, seed=2, haystack_text=corpus_text)
    needles = NEEDLE_RE.findall(s.input)
    assert len(needles) == 4 and len({k for k, _ in needles}) == 1
    assert sorted(v for _, v in needles) == sorted(s.outputs)

    (s,) = generate_task("niah_multiquery", tokenizer, 1024, 1, seed=2, haystack_text=corpus_text)
    needles = dict(NEEDLE_RE.findall(s.input))
    assert len(needles) == 4 and sorted(needles.values()) == sorted(s.outputs)
    question = s.input[s.input.rindex("What are all"):]
    assert all(k in question for k in needles)


@pytest.mark.parametrize("L", [1024, 2048])  # 2048 also prepends RULER's solved example
def test_variable_tracking_chain_resolves(L, tokenizer):
    for s in generate_task("vt", tokenizer, L, 2, seed=4):
        main = s.input[s.input.rindex("Memorize and track"):]
        if L >= 2048:
            assert s.input.count("Memorize and track") == 2
        assign = dict(re.findall(r"VAR ([A-Z]+) = (\d+|VAR [A-Z]+)", main))

        def resolve(v, assign=assign):
            while assign[v].startswith("VAR "):
                v = assign[v][4:]
            return assign[v]

        query = re.search(r"assigned the value (\d+) in the text above", main).group(1)
        assert {v for v in assign if resolve(v) == query} == set(s.outputs)
        assert len(s.outputs) == 5


def test_cwe_gold_are_most_common(tokenizer):
    for s in generate_task("cwe", tokenizer, 2048, 2, seed=6):
        main = s.input[s.input.rindex("Below is a numbered list"):]
        counts = Counter(re.findall(r"\d+\. ([a-z]+)", main))
        assert len(s.outputs) == 10
        gold_min = min(counts[w] for w in s.outputs)
        others = [c for w, c in counts.items() if w not in s.outputs]
        assert others and gold_min > max(others)


@pytest.mark.parametrize("L", [512, 1024])
def test_fwe_gold_are_most_frequent(L, tokenizer):
    for s in generate_task("fwe", tokenizer, L, 2, seed=7):
        text = s.input[s.input.index("coded words. ") + len("coded words. "): s.input.rindex("\nQuestion")]
        counts = Counter(w for w in text.split() if w != "...")
        assert len(s.outputs) == 3
        gold_min = min(counts[w] for w in s.outputs)
        assert gold_min >= 1
        assert all(c < gold_min for w, c in counts.items() if w not in s.outputs)


def test_left_padded_batches_match_single(model, tokenizer):
    prompts = ["The grass is green. The sky is", "Here we go"]
    one = generate_predictions(model, tokenizer, prompts, max_new_tokens=5, batch_size=1)
    two = generate_predictions(model, tokenizer, prompts, max_new_tokens=5, batch_size=2)
    assert one == two
    assert tokenizer.padding_side == "right"  # restored


def test_run_ruler_end_to_end(model, tokenizer):
    res = run_ruler(model, tokenizer, tasks=["niah_single_1", "vt"], lengths=[512], num_samples=2,
                    batch_size=2, max_new_tokens=8, return_samples=True)
    for t in ("niah_single_1", "vt"):
        assert 0.0 <= res["scores"][t][512] <= 100.0
    assert 0.0 <= res["average"][512] <= 100.0 and res["overall"] == res["average"][512]
    assert len(res["samples"]) == 4 and all("pred" in r for r in res["samples"])
    table = format_table(res)
    assert "| niah_single_1 |" in table and "| vt |" in table and "**average**" in table
    assert table.splitlines()[0] == "| task | 512 |"


def test_default_haystack_is_the_packaged_corpus(tokenizer):
    pytest.importorskip("fusedkv.data.sources")
    (s,) = generate_task("niah_single_2", tokenizer, 512, 1, seed=0)
    assert 0.8 * 512 <= s.length <= 512
    assert "God" in s.input or "LORD" in s.input  # KJV prose from the packaged corpus
    assert not re.search(r"(^|\n)\s*\d+ [A-Z]", s.input)  # verse numbers removed
