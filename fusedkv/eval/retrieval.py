"""Retrieval accuracy against context length and number of key-value pairs (the paper's Table 16, at toy scale).

The paper's long-context table says reconstructing K/V costs some retrieval (vanilla 49.1, Lite 42.3,
FusedKV 42.0, YOCO 17.3 at 128k; paper Sec. 4.3, Table 16). A tiny model scores zero on RULER, so this
module measures retrieval where it exists: on the synthetic tasks of `fusedkv.data.synthetic` that a model
trained on the mixture `mix:builtin:F` has seen, at lengths up to (and, after RoPE-base continued
training, beyond) its training context.

* **MQAR** grid: for each number of pairs P and length L, samples of P key-value pairs, natural filler
  from the *held-out* works up to L tokens (the gap), then P queries.
* **Passkey** row: a 5-digit key at a random depth in an L-token haystack of held-out text.
* **RULER-style** tasks (optional): `fusedkv.eval.ruler.run_ruler`, unchanged.

Scoring: an answer counts when every one of its tokens is the model's argmax given the gold text before
it, i.e. when greedy decoding from that point would produce exactly the answer (checked against
`fusedkv.generation.generate` in the tests). One forward scores all the queries of a sample at once, as
Zoology scores MQAR. Accuracy is the share of answers right (per query), in percent.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from ..data.ruler_tasks import _largest_fitting
from ..data.synthetic import TextSample, corpus_words, mqar_sample, passkey_sample

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

        hint, _, _ = _largest_fitting(lambda n: build(n).text, _count(tokenizer), length, 0, 2 * length, hint)
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
    """Teacher-forced exact match of every answer: {"accuracy" (% answers right), "sample_accuracy"
    (% samples with all answers right), "answers", "samples"}."""
    device = next(model.parameters()).device
    context = model.config.max_position_embeddings
    encoded = [encode_with_answers(tokenizer, s) for s in samples]
    too_long = [len(ids) for ids, _ in encoded if len(ids) > context]
    if too_long:
        raise ValueError(f"a sample has {max(too_long)} tokens, more than the model context {context}; "
                         "use shorter lengths or continue training at a longer context first")
    right = total = whole = 0
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
                ok = [all(int(pred[r, t - 1]) == ids[t] for t in span) for span in spans]
                right += sum(ok)
                total += len(ok)
                whole += all(ok)
    finally:
        model.train(was_training)
    return {"accuracy": 100.0 * right / max(1, total), "sample_accuracy": 100.0 * whole / max(1, len(encoded)),
            "answers": total, "samples": len(encoded)}


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


def format_retrieval(result: dict) -> str:
    """Markdown: one row per MQAR pair count and one for passkeys, one column per length."""
    lengths = result["lengths"]

    def cell(v):
        return "-" if v is None else f"{v:.1f}"

    lines = ["| task | " + " | ".join(str(L) for L in lengths) + " |", "|---|" + "---:|" * len(lengths)]
    for p in result["pairs"]:
        lines.append(f"| MQAR {p} pairs | " + " | ".join(cell(result["mqar"][p].get(L)) for L in lengths) + " |")
    lines.append("| passkey | " + " | ".join(cell(result["passkey"].get(L)) for L in lengths) + " |")
    for task, row in (result.get("ruler") or {}).get("scores", {}).items():
        lines.append(f"| {task} | " + " | ".join(cell(row.get(L)) for L in lengths) + " |")
    return "\n".join(lines)


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
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
