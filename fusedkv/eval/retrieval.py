"""Retrieval accuracy against context length and number of key-value pairs (the paper's Table 16, at toy scale).

The paper's long-context table says reconstructing K/V costs some retrieval (vanilla 49.1, Lite 42.3, FusedKV
42.0, YOCO 17.3 RULER average at 128k after long-context training; paper App. A.7, Table 16). A tiny model
scores zero on RULER, so this module measures retrieval where it exists: on the synthetic tasks of
`fusedkv.data.synthetic` that a model trained on the mixture `mix:builtin:F` has seen, at lengths up to (and,
after RoPE-base continued training, beyond) its training context.

* **MQAR** grid: for each number of pairs P and length L, samples of P key-value pairs, natural filler
  from the *held-out* works up to L tokens (the gap), then P queries.
* **Passkey** row: a 5-digit key at a random depth in an L-token haystack of held-out text.
* **RULER-style** tasks (optional): `fusedkv.eval.ruler.run_ruler`, unchanged.

Scoring: an answer counts when every one of its tokens is the model's argmax given the text before it,
i.e. when greedy decoding from that point would produce exactly the answer (checked against
`fusedkv.generation.generate` in the tests). An MQAR query is scored on its own prompt (`TextSample.scored`):
the pairs, the gap, the earlier queries each followed by a random value (never its answer, as in Zoology),
then the query and its gold value, so no earlier answer is visible and values of several tokens are
teacher-forced within their own answer only. Accuracy is the share of answers right (per query), in
percent. Floors (`floors`): a model that copies a random value of the P pairs scores 100/P (the
*random-copy floor*; with no earlier answer visible, eliminating the values already recalled gains
nothing), a uniform guess over the 90 two-digit values 100/90. A cell is *above the floor* when its
count of right answers is significantly above the random-copy floor (one-sided exact binomial test,
p < 0.05: `above_floor`).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence

import torch

from ..data.ruler_haystack import largest_fitting
from ..data.synthetic import TextSample, corpus_words, mqar_sample, passkey_sample
from ..utils import save_figure

DEFAULT_PAIRS = (4, 8, 16)


def _count(tokenizer):
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _filled_samples(tokenizer, prefix: str, length: int, num_samples: int, words: Sequence[str] | None,
                    make: Callable[[random.Random, list[str]], TextSample]) -> list[TextSample]:
    """`num_samples` samples of at most `length` tokens: sample i is `make(rng, filler)` with the longest
    run of held-out words that fits, its RNG and filler start seeded by `prefix` and i."""
    words = words if words is not None else _held_out_words()
    samples, hint = [], None
    for i in range(num_samples):
        key = f"{prefix}:{i}"
        start = random.Random(key + ":filler").randrange(len(words))

        def build(n: int, key=key, start=start) -> TextSample:
            return make(random.Random(key), [words[(start + j) % len(words)] for j in range(n)])

        hint, _, _ = largest_fitting(lambda n: build(n).text, _count(tokenizer), length, 0, 2 * length, hint)
        samples.append(build(hint))
    return samples


def mqar_samples(tokenizer, num_pairs: int, length: int, num_samples: int, seed: int = 0,
                 words: Sequence[str] | None = None) -> list[TextSample]:
    """`num_samples` MQAR samples of at most `length` tokens, filled with held-out text to that length.
    ValueError when `num_pairs` pairs and their queries alone do not fit in `length` tokens."""
    return _filled_samples(tokenizer, f"mqar:{num_pairs}:{length}:{seed}", length, num_samples, words,
                           lambda rng, gap: mqar_sample(rng, num_pairs, gap))


def passkey_samples(tokenizer, length: int, num_samples: int, seed: int = 0, depth: float | None = None,
                    words: Sequence[str] | None = None) -> list[TextSample]:
    """`num_samples` passkey samples of at most `length` tokens (random depths unless `depth` is given)."""
    return _filled_samples(tokenizer, f"passkey:{length}:{seed}", length, num_samples, words,
                           lambda rng, hay: passkey_sample(rng, hay, depth))


_HELD_OUT: list[str] = []


def _held_out_words() -> list[str]:
    if not _HELD_OUT:  # the corpus takes seconds to decompress: once per process
        _HELD_OUT.extend(corpus_words("val"))
    return _HELD_OUT


def encode_with_answers(tokenizer, sample: TextSample) -> tuple[list[int], list[list[int]]]:
    """Token ids of the sample's text and, per answer, the indices of the tokens that overlap its span."""
    enc = tokenizer(sample.text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    spans = []
    for a, b in sample.answers:
        idx = [t for t, (s, e) in enumerate(offsets) if s < b and e > a]
        if not idx or idx[0] == 0:
            raise ValueError(f"answer {sample.text[a:b]!r} has no token after the start of the text")
        spans.append(idx)
    return ids, spans


@torch.no_grad()
def score_samples(model, tokenizer, samples: Sequence[TextSample], batch_size: int = 8) -> dict:
    """Teacher-forced exact match of every answer, each scored on its sample's prompts (`TextSample.scored`:
    one per MQAR query): {"accuracy" (% answers right), "sample_accuracy" (% samples with all answers
    right), "answers", "samples"}."""
    device = next(model.parameters()).device
    context = model.config.max_position_embeddings
    prompts = [(i, p) for i, s in enumerate(samples) for p in s.scored()]
    encoded = [encode_with_answers(tokenizer, p) for _, p in prompts]
    too_long = [len(ids) for ids, _ in encoded if len(ids) > context]
    if too_long:
        raise ValueError(f"a sample has {max(too_long)} tokens, more than the model context {context}; "
                         "use shorter lengths or continue training at a longer context first")
    ok: list[list[bool]] = [[] for _ in samples]
    was_training = model.training
    model.eval()
    try:
        for b in range(0, len(encoded), batch_size):
            batch = encoded[b : b + batch_size]
            width = max(len(ids) for ids, _ in batch)
            # Right padding needs no mask: under causal attention no real position sees the padding.
            x = torch.zeros(len(batch), width, dtype=torch.long)
            for r, (ids, _) in enumerate(batch):
                x[r, : len(ids)] = torch.tensor(ids)
            pred = model(input_ids=x.to(device), use_cache=False).logits.argmax(-1).cpu()
            for r, (ids, spans) in enumerate(batch):
                ok[prompts[b + r][0]] += [all(int(pred[r, t - 1]) == ids[t] for t in span) for span in spans]
    finally:
        model.train(was_training)
    right, total = sum(map(sum, ok)), sum(map(len, ok))
    return {"accuracy": 100.0 * right / max(1, total),
            "sample_accuracy": 100.0 * sum(all(o) for o in ok) / max(1, len(samples)),
            "answers": total, "samples": len(samples)}


def run_retrieval(model, tokenizer, lengths: Sequence[int], pairs: Sequence[int] = DEFAULT_PAIRS,
                  num_samples: int = 20, seed: int = 0, ruler_tasks: Sequence[str] | None = None,
                  batch_size: int = 8) -> dict:
    """Accuracy (%) on MQAR for every (pairs, length), on passkeys for every length, and optionally on
    RULER-style tasks. A cell whose sample does not fit in the length (too many pairs) is None."""
    words = _held_out_words()
    mqar: dict[int, dict[int, float | None]] = {p: {} for p in pairs}
    passkey: dict[int, float | None] = {}
    for length in lengths:
        for p in pairs:
            try:
                samples = mqar_samples(tokenizer, p, length, num_samples, seed, words)
            except ValueError:  # the pairs alone are longer than `length`
                mqar[p][length] = None
                continue
            mqar[p][length] = score_samples(model, tokenizer, samples, batch_size)["accuracy"]
        try:
            samples = passkey_samples(tokenizer, length, num_samples, seed, words=words)
        except ValueError:  # the question alone is longer than `length`
            passkey[length] = None
            continue
        passkey[length] = score_samples(model, tokenizer, samples, batch_size)["accuracy"]
    out = {"lengths": list(lengths), "pairs": list(pairs), "num_samples": num_samples, "seed": seed,
           "mqar": mqar, "passkey": passkey}
    if ruler_tasks:
        from .ruler import run_ruler

        r = run_ruler(model, tokenizer, tasks=ruler_tasks, lengths=lengths, num_samples=num_samples,
                      batch_size=batch_size, seed=seed)
        out["ruler"] = {"scores": r["scores"], "average": r["average"]}
    return out


MQAR_VALUE_COUNT = 90  # two-digit values, 10-99: what a uniform guess chooses from
PASSKEY_COUNT = 90_000  # five-digit keys


def random_copy_floor(pairs: int) -> float:
    """Accuracy (%) of a model that answers every query with a value of the pair list taken at random."""
    return 100.0 / pairs


def uniform_floor() -> float:
    """Accuracy (%) of a uniform guess over the two-digit values."""
    return 100.0 / MQAR_VALUE_COUNT


def binomial_sf(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p): the one-sided exact p-value of k successes in n against p."""
    if k <= 0:
        return 1.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    logs = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * math.log(p)
            + (n - i) * math.log1p(-p) for i in range(k, n + 1)]
    top = max(logs)
    return min(1.0, math.exp(top) * sum(math.exp(x - top) for x in logs))


def above_floor(accuracy: float | None, pairs: int, num_samples: int, alpha: float = 0.05) -> bool | None:
    """Whether an MQAR cell (accuracy in %, `num_samples` samples of `pairs` queries each) is significantly
    above the random-copy floor: one-sided exact binomial test of its right answers against 1/`pairs`,
    p < `alpha`. None for a cell not scored."""
    if accuracy is None:
        return None
    n = num_samples * pairs
    return binomial_sf(round(accuracy * n / 100.0), n, 1.0 / pairs) < alpha


def learned(result: dict, length: int | None = None) -> bool:
    """Whether a model has learned the MQAR lookup at `length` (default: the shortest length scored): every
    pair count scored there is significantly above its random-copy floor (`above_floor`)."""
    samples = result.get("num_samples", 0)
    cells = {int(p): _get(row, length if length is not None else min(int(L) for L in result["lengths"]))
             for p, row in result["mqar"].items()}
    scored = {p: v for p, v in cells.items() if v is not None}
    return bool(scored) and all(above_floor(v, p, samples) for p, v in scored.items())


def format_retrieval(result: dict) -> str:
    """Markdown: one row per MQAR pair count and one for passkeys, one column per length, each MQAR row with
    its random-copy floor; `*` marks a cell significantly above that floor (`above_floor`)."""
    lengths = result["lengths"]
    samples = result.get("num_samples", 0)

    def cell(v, p=None):
        if v is None:
            return "-"
        return f"{v:.1f}" + ("*" if p and samples and above_floor(v, p, samples) else "")

    head = "| task | random-copy floor | " + " | ".join(str(L) for L in lengths) + " |"
    lines = [head, "|---|---:|" + "---:|" * len(lengths)]
    for p in result["pairs"]:
        row = _get(result["mqar"], p)
        lines.append(f"| MQAR {p} pairs | {random_copy_floor(p):.1f} | "
                     + " | ".join(cell(_get(row, L), p) for L in lengths) + " |")
    lines.append("| passkey | 0.0 | " + " | ".join(cell(_get(result["passkey"], L)) for L in lengths) + " |")
    for task, row in (result.get("ruler") or {}).get("scores", {}).items():
        lines.append(f"| {task} | | " + " | ".join(cell(_get(row, L)) for L in lengths) + " |")
    if samples:
        marks = (f"`*`: above the random-copy floor (one-sided exact binomial test over the {samples} x P answers, "
                 "p < 0.05).")
    else:  # a mean over seeds that answered the same questions is not one binomial sample
        marks = (f"A mean over {result.get('seeds', 'several')} seeds: no significance marks (the seeds that "
                 "learned the lookup are listed per seed).")
    return "\n".join(lines) + (f"\n\nFloors (%): random copy of one of the P values 100/P; a uniform guess over the "
                                f"{MQAR_VALUE_COUNT} values {uniform_floor():.1f}. " + marks)


def _get(d: dict, key):
    """A value stored under an int key in memory, a str key once it went through JSON."""
    return d.get(key, d.get(str(key)))


def plot_retrieval(results: dict[str, dict], path, title: str = "retrieval accuracy") -> str:
    """Accuracy against length, one line per model (`results`: name -> run_retrieval output); a panel per
    MQAR pair count and one for passkeys. Returns the path written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = next(iter(results.values()))
    panels = [(f"MQAR, {p} pairs", lambda r, p=p: r["mqar"][p]) for p in first["pairs"]]
    panels.append(("passkey", lambda r: r["passkey"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2), sharey=True, squeeze=False)
    # one colour per model in every panel: tab10 repeats from the eleventh model on
    palette = plt.get_cmap("tab10" if len(results) <= 10 else "tab20")
    colours = {name: palette(i % palette.N) for i, name in enumerate(results)}
    for ax, (label, get) in zip(axes[0], panels):
        for name, r in results.items():
            row = {int(k): v for k, v in get(r).items() if v is not None}
            if row:
                xs = sorted(row)
                ax.plot(xs, [row[x] for x in xs], marker="o", label=name, color=colours[name])
        ax.set_xscale("log", base=2)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy (%)")
    labelled = [ax for ax in axes[0] if ax.get_legend_handles_labels()[0]]
    if labelled:  # a panel whose cells all did not fit has no lines
        labelled[-1].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
    return str(path)


def mqar_score(retrieval: dict, length: int) -> float | None:
    """MQAR accuracy at one length averaged over the pair counts scored there (a count whose prompt did not
    fit is absent); None when none was. `retrieval` as `run_retrieval` returns it, or read back from JSON
    (whose keys are strings)."""
    vals = [row.get(length, row.get(str(length))) for row in retrieval["mqar"].values()]
    vals = [v for v in vals if v is not None]
    return statistics.mean(vals) if vals else None
