"""Synthetic retrieval data: associative recall and passkeys in text, and a training mixture that holds them.

Tiny models score zero on long-context suites (the paper's Table 16) because nothing in their training
asks them to retrieve. This module writes retrieval *as text documents*, so the ordinary shard pipeline
(`fusedkv.data.prepare_dataset`) tokenises them with the run's own BPE and the trainer needs no change:

* **MQAR** (multi-query associative recall, Zoology: Arora et al., 2023, arXiv:2312.04927), as Zoology
  defines it: a block of key-value pairs with distinct keys and distinct values (`Pairs: apple 37, river
  82, ...`), optionally natural text in between (the *gap*, so length varies independently of the number
  of pairs), then queries that repeat keys in another order. As in Zoology the input at every answer
  position is a random token, not the answer: here a random value of the same width that is none of the
  sample's values (`Recall: river 54, apple 19.`), so no earlier query's answer is visible and a later
  query cannot be answered by elimination. Each query is scored on its own prompt, the text up to its
  key followed by its gold value (`TextSample.scored`), which handles values of several tokens; a
  model that copies a value of the pair list at random scores 1/P (the *random-copy floor*), one that
  guesses a value uniformly 1/90. Format version `MQAR_FORMAT` (2); version 1 (values drawn with
  replacement, earlier answers visible) was withdrawn (docs/evidence.md).
* **Passkey** (Mohtashami & Jaggi, 2023; the needle-in-a-haystack test): one number hidden at a random
  depth in natural text from the built-in corpus, asked for at the end.
* **RULER-style** tasks: the project's generators (`fusedkv.data.ruler_tasks`), reused as they are, with
  the prompt followed by the gold answer.
* **Repeat**: a random list of MQAR's key and value words, then the same list again. Every word of the
  second copy is predictable only by finding the current word earlier and copying the one after it (an
  induction head, Olsson et al., 2022), the mechanism MQAR needs, supervised at every position instead of
  once per pair. Not in the default mixture; `tasks=mqar+repeat` selects it.

Every sample records the character spans of the answers, so an evaluation can score exactly the answer
tokens (`fusedkv.eval.retrieval`). Everything is deterministic in (seed, index) and offline.

The mixture is a data-source spec: ``mix:builtin:FRACTION[:words=N][:tasks=A+B][:loss=all|answers][:mqar=2]``
(e.g. ``--data mix:builtin:0.25``) is the built-in corpus plus synthetic documents making up FRACTION of the characters,
each about N words of filler (default 80: sized to a 128-token training context). ``tasks`` picks the
synthetic tasks, in equal shares (default: MQAR 50%, passkey 30%, RULER-style 20%). ``loss=answers``
trains the synthetic documents on their answer tokens only (Zoology's MQAR objective; `TargetedText`, a
loss mask in the shards); the default ``loss=all`` trains on every token, like the corpus. Validation
stays on the corpus's held-out works (the synthetic documents all go to training), so validation losses
compare with corpus-only runs. A mixture with MQAR names its format (``:mqar=2``) in its spec, so data of a
withdrawn format is never taken for the current one: `versioned_spec` adds it to a spec that omits it
(`fusedkv compare` keys its cached runs on that).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ._ruler_words import NOUNS
from .ruler_tasks import generate_task
from .sources import BUILTIN_VAL_DOCS, BuiltinSource, TargetedText

TASKS = ("mqar", "passkey", "ruler", "repeat")
DEFAULT_TASKS = ("mqar", "passkey", "ruler")
DEFAULT_WEIGHTS = (0.5, 0.3, 0.2)
# RULER-style tasks cheap enough to generate by the thousand and short enough for a small context.
RULER_TRAIN_TASKS = ("niah_single_1", "niah_single_2", "niah_multikey_1", "niah_multivalue", "vt")
PASSKEY_QUESTION = "What is the pass key? The pass key is"


@dataclass
class TextSample:
    """One synthetic document: its text and the [start, end) character spans of the answers in it."""

    task: str
    text: str
    answers: list[tuple[int, int]] = field(default_factory=list)
    num_pairs: int = 0  # MQAR: key-value pairs; passkey: 1
    depth: float | None = None  # passkey: where the needle sits (0 = start, 1 = end)
    # MQAR: the gold values. The text holds a random value (a distractor) at each answer span instead,
    # so a query is scored on its own prompt (`scored`), never on text where an earlier answer shows.
    golds: list[str] | None = None

    def answer_strings(self) -> list[str]:
        return list(self.golds) if self.golds is not None else [self.text[a:b] for a, b in self.answers]

    def scored(self) -> list[TextSample]:
        """The texts to score, each with its answers in place: the sample itself when its answers stand in
        its text; for MQAR one prompt per query, the text up to that query's answer (earlier answers
        distractors) followed by its gold value."""
        if self.golds is None:
            return [self]
        return [TextSample(self.task, self.text[:a] + gold, [(a, a + len(gold))], self.num_pairs)
                for (a, _), gold in zip(self.answers, self.golds)]


def _keys(rng: random.Random, n: int) -> list[str]:
    if n > len(NOUNS):
        raise ValueError(f"num_pairs={n}: at most {len(NOUNS)} distinct keys are available")
    return rng.sample(NOUNS, n)


def _values(rng: random.Random, n: int, digits: int) -> list[str]:
    return [str(rng.randrange(10 ** (digits - 1), 10**digits)) for _ in range(n)]


def _value_pool(digits: int) -> list[str]:
    return [str(v) for v in range(10 ** (digits - 1), 10**digits)]


MQAR_FORMAT = 2  # 1: values with replacement, earlier gold answers in the scored text (withdrawn)


def mqar_sample(rng: random.Random, num_pairs: int, filler: Sequence[str] = (), num_queries: int | None = None,
                value_digits: int = 2) -> TextSample:
    """Zoology's MQAR in text: `num_pairs` pairs of distinct keys and distinct values, the `filler` words
    (the gap), then `num_queries` (default all) keys in a shuffled order. Each query is followed by a
    distractor, a random value of the same width that is none of this sample's values (Zoology's random
    token at the answer position); the gold values are `golds`, scored one prompt per query (`scored`)."""
    if num_pairs < 1:
        raise ValueError(f"num_pairs={num_pairs}: need at least one key-value pair")
    num_queries = num_pairs if num_queries is None else num_queries
    if not 1 <= num_queries <= num_pairs:
        raise ValueError(f"num_queries={num_queries}: must be between 1 and num_pairs={num_pairs}")
    pool = _value_pool(value_digits)
    if num_pairs >= len(pool):
        raise ValueError(f"num_pairs={num_pairs}: needs fewer than {len(pool)} distinct {value_digits}-digit values")
    keys, values = _keys(rng, num_pairs), rng.sample(pool, num_pairs)
    text = "Pairs: " + ", ".join(f"{k} {v}" for k, v in zip(keys, values)) + ".\n"
    if filler:
        text += " ".join(filler) + "\n"
    text += "Recall:"
    order = rng.sample(range(num_pairs), num_queries)
    others = sorted(set(pool) - set(values))
    distractors = [rng.choice(others) for _ in order]
    answers = []
    for j, (i, d) in enumerate(zip(order, distractors)):
        text += f" {keys[i]} "
        answers.append((len(text), len(text) + len(d)))
        text += d + ("," if j < num_queries - 1 else ".")
    return TextSample("mqar", text + "\n", answers, num_pairs=num_pairs, golds=[values[i] for i in order])


def passkey_sample(rng: random.Random, haystack: Sequence[str], depth: float | None = None,
                   digits: int = 5) -> TextSample:
    """A `digits`-digit pass key stated once at `depth` (default random) inside the `haystack` words."""
    depth = rng.random() if depth is None else depth
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth}: must be in [0, 1]")
    key = _values(rng, 1, digits)[0]
    cut = round(depth * len(haystack))
    before, after = " ".join(haystack[:cut]), " ".join(haystack[cut:])
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    text = " ".join(p for p in (before, needle, after) if p) + f"\n{PASSKEY_QUESTION} "
    answers = [(len(text), len(text) + len(key))]
    return TextSample("passkey", text + key + ".\n", answers, num_pairs=1, depth=depth)


def repeat_sample(rng: random.Random, length: int) -> TextSample:
    """`length` words drawn from MQAR's keys and two-digit values, then the same words again; the answers are
    the words of the second copy after its first (each follows a word whose successor is in context)."""
    if length < 2:
        raise ValueError(f"length={length}: a repeated list needs at least 2 words")
    words = [rng.choice(NOUNS) if rng.random() < 0.5 else _values(rng, 1, 2)[0] for _ in range(length)]
    text = "Repeat: " + " ".join(words) + ".\nAgain: " + words[0]
    answers = []
    for w in words[1:]:
        text += " "
        answers.append((len(text), len(text) + len(w)))
        text += w
    return TextSample("repeat", text + ".\n", answers, num_pairs=length)


def ruler_sample(task: str, length_words: int, seed: int, index: int, haystack_text: str | None = None) -> TextSample:
    """A RULER-style prompt (`fusedkv.data.ruler_tasks`, unchanged) of about `length_words` words followed by
    its gold answers, as one training document. Length is counted in whitespace words (no tokenizer exists
    yet when training data is written)."""
    words = _WhitespaceTokenizer()
    sample = generate_task(task, words, length_words, 1, seed=seed * 1_000_003 + index, haystack_text=haystack_text)[0]
    text = sample.input
    answers = []
    for j, out in enumerate(sample.outputs):
        text += " " if j == 0 else ", "
        answers.append((len(text), len(text) + len(out)))
        text += out
    return TextSample(task, text + ".\n", answers, num_pairs=len(sample.outputs))


class _WhitespaceTokenizer:
    """Counts words: what `generate_task` needs to size a prompt before any BPE exists."""

    def __call__(self, text: str) -> dict:
        return {"input_ids": text.split()}


# ---- natural-text filler --------------------------------------------------------------------------------
def corpus_words(split: str = "train") -> list[str]:
    """The built-in corpus as words: the training works ("train") or the held-out works ("val"), so that
    evaluation haystacks are text the model never trained on."""
    if split not in ("train", "val"):
        raise ValueError(f"split={split!r}: choose 'train' or 'val'")
    held_out = set(BUILTIN_VAL_DOCS)
    words: list[str] = []
    for name, text in BuiltinSource().iter_named():
        if (name in held_out) == (split == "val"):
            words.extend(text.split())
    return words


def filler(rng: random.Random, words: Sequence[str], n: int) -> list[str]:
    """`n` consecutive words from a random place in `words` (wrapping around)."""
    if n <= 0:
        return []
    start = rng.randrange(len(words))
    return [words[(start + i) % len(words)] for i in range(n)]


def training_sample(rng: random.Random, words: Sequence[str], length_words: int, seed: int, index: int,
                    tasks: Sequence[str] = DEFAULT_TASKS) -> TextSample:
    """One training document of a random task and size, at most about `length_words` words long: MQAR with
    2-16 pairs and a random gap (half of them), one query scored, passkeys at random depths, RULER-style
    tasks, repeated lists of up to half that many words. `tasks` other than the default are drawn in equal shares."""
    weights = DEFAULT_WEIGHTS if tuple(tasks) == DEFAULT_TASKS else None
    kind = rng.choices(tasks, weights=weights)[0]
    if kind == "mqar":
        pairs = rng.randint(2, max(2, min(16, length_words // 5)))
        gap = rng.randint(0, max(0, length_words - 4 * pairs)) if rng.random() < 0.5 else 0
        # One scored query per document (the last one shown; the earlier ones carry distractors): a target
        # token is also the next input, so a document with several answers would show the earlier ones.
        prompt = rng.choice(mqar_sample(rng, pairs, filler(rng, words, gap)).scored())
        return TextSample("mqar", prompt.text + ".\n", prompt.answers, num_pairs=pairs)
    if kind == "passkey":
        return passkey_sample(rng, filler(rng, words, rng.randint(length_words // 4, length_words)))
    if kind == "repeat":
        return repeat_sample(rng, rng.randint(4, max(4, length_words // 2)))
    task = rng.choice(RULER_TRAIN_TASKS)
    # RULER's instructions alone are ~90 words: these documents run past a short training context.
    return ruler_sample(task, max(2 * length_words, 160), seed, index, haystack_text=" ".join(filler(rng, words, 2000)))


# ---- the training mixture as a data source ---------------------------------------------------------------
MIX_PREFIX = "mix:"


class MixtureSource(BuiltinSource):
    """The built-in corpus plus synthetic retrieval documents (`fraction` of all characters), as one source.

    A BuiltinSource, so `prepare_dataset` holds out the same works for validation; the synthetic
    documents are named `synthetic/<task>/<i>` and all go to training. Synthetic documents are spread
    evenly through the corpus's documents (not appended at the end), so a tokenizer trained on a prefix
    of the text sees them too."""

    def __init__(self, fraction: float, words: int = 80, seed: int = 0, tasks: Sequence[str] = DEFAULT_TASKS,
                 loss: str = "all"):
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"mixture fraction {fraction}: must be in (0, 1), e.g. mix:builtin:0.25")
        if words < 16:
            raise ValueError(f"mixture words={words}: synthetic documents need at least 16 words")
        unknown = [t for t in tasks if t not in TASKS]
        if unknown or not tasks or len(set(tasks)) != len(tasks):
            raise ValueError(f"mixture tasks {'+'.join(tasks) or '(none)'}: name each of {', '.join(TASKS)} at most "
                             f"once, joined by '+', e.g. tasks=mqar+repeat")
        if loss not in ("all", "answers"):
            raise ValueError(f"mixture loss={loss}: choose loss=all (every token) or loss=answers (the answers of "
                             f"the synthetic documents only)")
        self.fraction, self.words, self.seed, self.tasks = float(fraction), int(words), int(seed), tuple(tasks)
        self.has_targets = loss == "answers"
        self.spec = f"{MIX_PREFIX}builtin:{self.fraction:g}:words={self.words}:seed={self.seed}"
        if self.tasks != DEFAULT_TASKS:  # the default spec (and so cached datasets' fingerprints) unchanged
            self.spec += f":tasks={'+'.join(self.tasks)}"
        if self.has_targets:
            self.spec += ":loss=answers"
        if "mqar" in self.tasks:  # the MQAR format is part of what the data is: a new one is a new dataset
            self.spec += f":mqar={MQAR_FORMAT}"

    @classmethod
    def from_spec(cls, spec: str) -> MixtureSource:
        """`mix:builtin:0.25[:words=80][:seed=0][:tasks=mqar+repeat][:loss=answers][:mqar=2]` -> a MixtureSource;
        ValueError with the form otherwise."""
        form = ("expected 'mix:builtin:FRACTION[:words=N][:seed=S][:tasks=A+B][:loss=all|answers][:mqar=2]', "
                "e.g. 'mix:builtin:0.25'")
        parts = spec[len(MIX_PREFIX):].split(":")
        if len(parts) < 2 or parts[0] != "builtin":
            raise ValueError(f"data mixture {spec!r}: {form} (only the built-in corpus can be mixed)")
        try:
            fraction = float(parts[1])
            opts = dict(p.split("=", 1) for p in parts[2:])
            unknown = set(opts) - {"words", "seed", "tasks", "loss", "mqar"}
            if unknown:
                raise ValueError(f"unknown option(s) {sorted(unknown)}")
            if opts.get("mqar", str(MQAR_FORMAT)) != str(MQAR_FORMAT):
                raise ValueError(f"mqar={opts['mqar']}: only MQAR format {MQAR_FORMAT} is generated (format 1, values "
                                 f"with replacement and earlier answers visible, was withdrawn)")
            tasks = tuple(opts["tasks"].split("+")) if "tasks" in opts else DEFAULT_TASKS
            return cls(fraction, int(opts.get("words", 80)), int(opts.get("seed", 0)), tasks, opts.get("loss", "all"))
        except ValueError as e:
            raise ValueError(f"data mixture {spec!r}: {e}; {form}") from None

    def _iter_raw(self) -> Iterator[tuple[str, str]]:
        docs = list(self._base_docs())
        words = [w for n, t in docs if n not in BUILTIN_VAL_DOCS for w in t.split()]  # filler: training works only
        natural = sum(len(t) for n, t in docs if n not in BUILTIN_VAL_DOCS)
        target = natural * self.fraction / (1.0 - self.fraction)  # synthetic chars for the wanted share
        rng = random.Random(f"mixture:{self.seed}")
        synthetic: list[tuple[str, str]] = []
        made = 0
        while made < target:
            s = training_sample(rng, words, self.words, self.seed, len(synthetic), self.tasks)
            text = TargetedText(s.text, s.answers) if self.has_targets else s.text
            synthetic.append((f"synthetic/{s.task}/{len(synthetic)}", text))
            made += len(s.text)
        # Interleave: after each corpus document, its share of the synthetic documents.
        per_doc = len(synthetic) / max(1, len(docs))
        emitted = 0
        for i, doc in enumerate(docs):
            yield doc
            upto = round((i + 1) * per_doc)
            yield from synthetic[emitted:upto]
            emitted = upto

    def _base_docs(self) -> Iterator[tuple[str, str]]:
        """The natural-text documents the synthetic ones are mixed into (the built-in corpus)."""
        return super()._iter_raw()

    def fingerprint(self) -> str:
        return f"{self.spec}:{super().fingerprint()}"


def versioned_spec(data: str) -> str:
    """A data spec as it names its data: a mixture with MQAR gets the MQAR format it is generated in
    (``:mqar=2``) when it does not say it, so a cache keyed on the spec never takes runs trained on a
    withdrawn format for this one; any other spec is returned unchanged."""
    if not isinstance(data, str) or not data.startswith(f"{MIX_PREFIX}builtin:"):
        return data
    opts = dict(p.split("=", 1) for p in data.split(":")[3:] if "=" in p)
    if "mqar" in opts or "mqar" not in opts.get("tasks", "+".join(DEFAULT_TASKS)).split("+"):
        return data
    return f"{data}:mqar={MQAR_FORMAT}"
