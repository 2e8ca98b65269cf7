"""RULER-style synthetic long-context *task generation* (prompts + gold answers); see ruler.py to run/score.

Re-implements the synthetic task families of RULER (Hsieh et al., 2024, arXiv:2404.06654) so that
they run offline with any Hugging Face tokenizer and causal LM:

* needle in a haystack (NIAH): ``niah_single_1`` (a noise sentence repeated, numeric value),
  ``niah_single_2`` (essay haystack, numeric value), ``niah_single_3`` (essay, uuid value),
  ``niah_multikey_1`` (essay, three distractor needles with other keys), ``niah_multikey_2`` (the
  haystack is made entirely of word-key/number needles), ``niah_multikey_3`` (haystack of
  uuid-key/uuid-value needles), ``niah_multivalue`` (four values for one key),
  ``niah_multiquery`` (four keys asked at once);
* multi-hop tracing: ``vt`` (variable tracking, ``VAR X = 12345``, ``VAR Y = VAR X``, ...);
* aggregation: ``cwe`` (common words extraction), ``fwe`` (frequent coded-words extraction).

RULER's QA tasks (SQuAD / HotpotQA) need those data sets, which cannot be downloaded here and are
not shipped, so they are not implemented. Templates, needle formats, task parameters and the
scoring follow RULER; word keys come from :mod:`fusedkv.data._ruler_words` instead of `wonderwords`.

Length: ``length_tokens`` bounds the *prompt* (template + haystack + answer prefix) measured with the
tokenizer as the model will see it (``tokenizer(text)``, special tokens included). The haystack size
is the largest that fits, found by a galloping/binary search per sample. RULER instead reserves the
generation budget inside its ``max_seq_length``; to reproduce its exact prompt sizes pass
``length - max_new_tokens``.

The essay haystack defaults to the packaged public-domain corpus (``fusedkv.data.sources``, KJV
prose); pass ``haystack_text`` to use any other text. The haystacks and the sizing search are
``fusedkv.data.ruler_haystack``. The generators are data, used by the evaluation
(`fusedkv.eval.ruler`) and by the synthetic training documents (`fusedkv.data.synthetic`).
"""

from __future__ import annotations

import math
import random
import string
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from ._ruler_words import ADJECTIVES, NOUNS, word_pool
from .ruler_haystack import (
    NOISE,
    REAL_WORDS,
    essay_words,
    insert_at,
    largest_fitting,
    repeat_context,
    sentences,
)

NEEDLE = "One of the special magic {kind} for {key} is: {value}."
# RULER samples needle depths from 40 evenly spaced percentages.
DEPTHS = [round(100 * i / 39) / 100 for i in range(40)]
_KIND = {"numbers": ("number", "numbers"), "uuids": ("uuid", "uuids"), "words": ("word", "words")}


@dataclass
class Sample:
    task: str
    input: str  # the full prompt, ending with the answer prefix the model continues
    outputs: list[str]  # gold strings, all of which (metric "all") or any of which ("part") count
    length: int  # prompt length in tokens (<= max_length)
    max_length: int
    depth: float | None = None  # NIAH: depth fraction (0 = start, 1 = end) of the first gold needle
    max_new_tokens: int = 128


@dataclass(frozen=True)
class TaskSpec:
    name: str
    kind: str  # "niah" | "vt" | "cwe" | "fwe"
    metric: str  # "all" -> string_match_all, "part" -> string_match_part (RULER's QA)
    max_new_tokens: int  # RULER's tokens_to_generate
    haystack: str = ""  # NIAH: "repeat" | "essay" | "needle"
    key_type: str = "words"
    value_type: str = "numbers"
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1


TASKS: dict[str, TaskSpec] = {
    s.name: s
    for s in [
        TaskSpec("niah_single_1", "niah", "all", 128, haystack="repeat"),
        TaskSpec("niah_single_2", "niah", "all", 128, haystack="essay"),
        TaskSpec("niah_single_3", "niah", "all", 128, haystack="essay", value_type="uuids"),
        TaskSpec("niah_multikey_1", "niah", "all", 128, haystack="essay", num_keys=4),
        TaskSpec("niah_multikey_2", "niah", "all", 128, haystack="needle"),
        TaskSpec("niah_multikey_3", "niah", "all", 128, haystack="needle", key_type="uuids", value_type="uuids"),
        TaskSpec("niah_multivalue", "niah", "all", 128, haystack="essay", num_values=4),
        TaskSpec("niah_multiquery", "niah", "all", 128, haystack="essay", num_keys=4, num_queries=4),
        TaskSpec("vt", "vt", "all", 30),
        TaskSpec("cwe", "cwe", "all", 120),
        TaskSpec("fwe", "fwe", "all", 50),
    ]
}

# ------------------------------------------------------------------------------------- shared helpers
def _random_value(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))  # 7 digits, as RULER
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if kind == "words":
        return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
    raise ValueError(f"unknown needle type {kind!r}")


# --------------------------------------------------------------------------------------- task builders
def _niah_builder(spec: TaskSpec, rng: random.Random, depth: float | None, words: Sequence[str] | None):
    n_keys = max(spec.num_keys, spec.num_queries)
    keys: list[str] = []
    while len(keys) < n_keys:
        k = _random_value(spec.key_type, rng)
        if k not in keys:
            keys.append(k)
    values = [[_random_value(spec.value_type, rng) for _ in range(spec.num_values)] for _ in keys]
    plural = _KIND[spec.value_type][1]
    needles = [(i, NEEDLE.format(kind=plural, key=keys[i], value=v)) for i in range(n_keys) for v in values[i]]
    rng.shuffle(needles)
    queried = rng.sample(range(n_keys), spec.num_queries)
    answers = [v for i in queried for v in values[i]]
    query = keys[queried[0]] if len(queried) == 1 else ", ".join(keys[i] for i in queried[:-1]) + \
        ", and " + keys[queried[-1]]
    if depth is None:
        fracs = rng.sample(DEPTHS, len(needles)) if len(needles) <= len(DEPTHS) else \
            [rng.random() for _ in needles]
    else:  # every gold needle at the requested depth; distractors stay random
        fracs = [depth if i in queried else rng.choice(DEPTHS) for i, _ in needles]
    items = [(f, text) for f, (_, text) in zip(fracs, needles)]
    first_gold = min(f for f, (i, _) in zip(fracs, needles) if i in queried)

    if spec.num_queries * spec.num_values == 1:
        kind = _KIND[spec.value_type][0]
        head = f"A special magic {kind} is hidden within the following text. Make sure to memorize it. " \
               f"I will quiz you about the {kind} afterwards.\n"
        tail = f"\nWhat is the special magic {kind} for {query} mentioned in the provided text? " \
               f"The special magic {kind} for {query} mentioned in the provided text is"
    else:
        head = f"Some special magic {plural} are hidden within the following text. Make sure to memorize " \
               f"it. I will quiz you about the {plural} afterwards.\n"
        tail = f"\nWhat are all the special magic {plural} for {query} mentioned in the provided text? " \
               f"The special magic {plural} for {query} mentioned in the provided text are"

    distractors: list[str] = []
    key_iter: list[str] = []  # remaining distinct distractor keys (word keys), never a real key

    def distractor(j: int) -> str:  # lazily extended so that n can grow during the search
        while len(distractors) <= j:
            if spec.key_type == "words":
                if not key_iter:  # distinct keys while the pool lasts, then a fresh permutation
                    key_iter.extend(f"{a}-{b}" for a in ADJECTIVES for b in NOUNS if f"{a}-{b}" not in keys)
                    rng.shuffle(key_iter)
                k = key_iter.pop()
            else:
                k = _random_value(spec.key_type, rng)
            distractors.append(NEEDLE.format(kind=plural, key=k, value=_random_value(spec.value_type, rng)))
        return distractors[j]

    def build(n: int) -> str:
        if spec.haystack == "repeat":
            return head + repeat_context(n, items) + tail
        if spec.haystack == "needle":
            units, sep = [distractor(j) for j in range(n)], "\n"
        else:
            units, sep = sentences([words[j % len(words)] for j in range(n)]), " "
        return head + sep.join(insert_at(units, items)) + tail

    return build, answers, first_gold


def _vt_chain(rng: random.Random, num_hops: int, letters: int) -> tuple[list[str], list[str], str]:
    names: list[str] = []
    while len(names) < num_hops + 1:
        v = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if v not in names:
            names.append(v)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(num_hops)]
    return names, chain, value


_VT_HEAD = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"


def _vt_prompt(context: str, value: str, num_v: int) -> str:
    return (_VT_HEAD + context + f"\nQuestion: Find all variables that are assigned the value {value} in the "
            f"text above. Answer: According to the chain(s) of variable assignment in the text above, "
            f"{num_v} variables are assigned the value {value}, they are:")


def _vt_builder(rng: random.Random, length_tokens: int, num_hops: int = 4):
    names, chain, value = _vt_chain(rng, num_hops, 5)
    fracs = sorted(rng.random() for _ in chain)  # chain statements in order, spread over the noise
    prefix = ""
    if length_tokens >= 2048:  # RULER prepends one solved example; it only fits in longer prompts
        ex_names, ex_chain, ex_value = _vt_chain(rng, num_hops, 3)
        ex_units = insert_at([NOISE] * 5, [(rng.random(), s) for s in ex_chain])
        prefix = _vt_prompt("\n".join(ex_units), ex_value, num_hops + 1) + " " + " ".join(ex_names) + "\n\n"

    def build(n: int) -> str:
        units = insert_at([NOISE] * n, list(zip(fracs, chain)))
        return prefix + _vt_prompt("\n".join(units), value, num_hops + 1)

    return build, names


_CWE_HEAD = ("Below is a numbered list of words. In these words, some appear more often than others. "
             "Memorize the ones that appear most often.\n")
_CWE_TAIL = ("\nQuestion: What are the 10 most common words in the above list? Answer: The top 10 words "
             "that appear most often in the list are:")


def _numbered(words: Sequence[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _cwe_builder(rng: random.Random, length_tokens: int, sample_key: str, num_cw: int = 10):
    # RULER's frequencies: below 4k tokens commons appear 6x and the rest once (example 3x / 1x),
    # from 4k on 30x / 3x (example 10x / 3x).
    freq_cw, freq_ucw, ex_n, ex_cw, ex_ucw = (6, 1, 20, 3, 1) if length_tokens < 4096 else (30, 3, 40, 10, 3)
    # Each list entry costs >= 2 tokens, so length/2 distinct words always suffice. Real English words
    # come first in the per-sample order; pseudo-words are only reached by long prompts.
    pool = word_pool(length_tokens // 2)
    real = [w for w in pool if w in REAL_WORDS]
    ex_words = rng.sample(real, ex_n)
    ex_list = ex_words[:num_cw] * ex_cw + ex_words[num_cw:] * ex_ucw
    rng.shuffle(ex_list)
    example = _CWE_HEAD + _numbered(ex_list) + _CWE_TAIL + " " + _numbered(ex_words[:num_cw]) + "\n"
    pseudo = pool[len(real):]
    perm = rng.sample(real, len(real)) + rng.sample(pseudo, len(pseudo))  # n words are always perm[:n]

    def build(n: int) -> str:
        words = perm[:n]
        lst = words[:num_cw] * freq_cw + words[num_cw:] * freq_ucw
        random.Random(f"{sample_key}:{n}").shuffle(lst)
        return example + _CWE_HEAD + _numbered(lst) + _CWE_TAIL

    return build, perm[:num_cw], num_cw + 1, len(pool)


def _zeta(alpha: float, terms: int = 10000) -> float:
    # partial sum plus the integral tail; exact to ~1e-8 for alpha = 2
    return sum(k**-alpha for k in range(1, terms + 1)) + terms ** (1 - alpha) / (alpha - 1)


def _fwe_builder(rng: random.Random, length_tokens: int, sample_key: str, alpha: float = 2.0):
    vocab_size = max(8, length_tokens // 50)  # RULER: max_seq_length // 50 coded words
    vocab: list[str] = []
    while len(vocab) < vocab_size:
        w = "".join(rng.choices(string.ascii_lowercase, k=6))
        if w not in vocab:
            vocab.append(w)
    vocab[0] = "..."  # the top-ranked "word" is noise the model must ignore
    z = _zeta(alpha)

    def counts(n: int) -> list[int]:
        c = [int(n * (k**-alpha) / z) for k in range(1, vocab_size + 1)]
        # Zipf counts are floored; cap ranks >= 5 below rank 4 so the 3 gold words are strictly the
        # most frequent even in short prompts (RULER leaves ties possible).
        return c[:4] + [min(x, max(0, c[3] - 1)) for x in c[4:]]

    def build(n: int) -> str:
        words = [w for w, k in zip(vocab, counts(n)) for _ in range(k)]
        random.Random(f"{sample_key}:{n}").shuffle(words)
        return ("Read the following coded text and track the frequency of each coded word. Find the three "
                "most frequently appeared coded words. " + " ".join(words) + "\nQuestion: Do not provide any "
                "explanation. Please ignore the dots '....'. What are the three most frequently appeared "
                "words in the above coded text? Answer: According to the coded text above, the three most "
                "frequently appeared words are:")

    n_min = math.ceil(16 * z) + 1  # smallest n where the rank-4 word appears at least once
    return build, vocab[1:4], n_min


def generate_task(
    task_name: str,
    tokenizer,
    length_tokens: int,
    num_samples: int,
    seed: int = 0,
    depth: float | None = None,
    haystack_text: str | None = None,
) -> list[Sample]:
    """Generate ``num_samples`` prompts of task ``task_name`` of at most ``length_tokens`` tokens each.

    ``depth`` (0..1) fixes where NIAH gold needles go (default: RULER's random depths). Samples are
    deterministic in (task, length, seed, index). ``haystack_text`` replaces the essay haystack.
    """
    if task_name not in TASKS:
        raise KeyError(f"unknown RULER task {task_name!r}; known: {sorted(TASKS)}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError("depth must be in [0, 1]")
    spec = TASKS[task_name]

    def count(text: str) -> int:
        return len(tokenizer(text)["input_ids"])

    words = essay_words(haystack_text) if spec.kind == "niah" and spec.haystack == "essay" else None
    samples: list[Sample] = []
    hint = None
    for i in range(num_samples):
        key = f"{task_name}:{length_tokens}:{seed}:{i}"
        rng = random.Random(key)
        n_min, n_max, sample_depth = 0, length_tokens, None
        if spec.kind == "niah":
            build, outputs, sample_depth = _niah_builder(spec, rng, depth, words)
            if spec.haystack == "essay":
                n_max = 4 * length_tokens  # words; a short haystack text is cycled
        elif spec.kind == "vt":
            build, outputs = _vt_builder(rng, length_tokens)
        elif spec.kind == "cwe":
            build, outputs, n_min, n_max = _cwe_builder(rng, length_tokens, key)
        else:
            build, outputs, n_min = _fwe_builder(rng, length_tokens, key)
            n_max = 8 * length_tokens
        hint, text, ntok = largest_fitting(build, count, length_tokens, n_min, n_max, hint)
        samples.append(Sample(task=task_name, input=text, outputs=list(outputs), length=ntok,
                              max_length=length_tokens, depth=sample_depth, max_new_tokens=spec.max_new_tokens))
    return samples
