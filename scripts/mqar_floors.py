"""The floors of MQAR, measured: scripted predictors scored by the real scorer (`fusedkv.eval.retrieval`).

A scripted predictor reads its input like a model (never ahead) and, after each query key of the Recall
section, predicts the tokens of the value its strategy picks, as greedy decoding would emit them:

* `lookup`: the key's own value (a perfect model: 100%);
* `copy`: a value of the pair list at random (the random-copy floor, 100/P);
* `eliminate`: a value of the list not seen in the Recall section so far (in format 2 no earlier answer is
  visible, so nothing is eliminated and it equals `copy`; in the withdrawn format 1 it scores H_P/P);
* `uniform`: any two-digit number (100/90).

    python scripts/mqar_floors.py --tokenizer runs/data/DATASET/tokenizer [--samples 50]

prints one row per (pairs, length) with each predictor's accuracy, and the same eliminator on the samples
with every gold value written in its slot (format 1). `tests/eval/test_retrieval.py` runs these predictors
on a small BPE and checks the floors.
"""

from __future__ import annotations

import argparse
import random
import re
from types import SimpleNamespace

import torch

STRATEGIES = ("lookup", "copy", "eliminate", "uniform")


class ScriptedMQAR(torch.nn.Module):
    """A scripted MQAR predictor with the model interface `score_samples` uses (`config`, `forward`)."""

    def __init__(self, tokenizer, strategy: str, seed: int = 0):
        super().__init__()
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy {strategy!r}: choose one of {STRATEGIES}")
        self.config = SimpleNamespace(max_position_embeddings=10_000)
        self.tok, self.strategy, self.seed = tokenizer, strategy, seed
        self.w = torch.nn.Parameter(torch.zeros(1))  # a parameter, so `score_samples` finds a device

    def _pick(self, kv: dict, key: str, recalled: str, rng: random.Random) -> str:
        if self.strategy == "lookup":
            return kv[key]
        if self.strategy == "uniform":
            return str(rng.randrange(10, 100))
        values = list(kv.values())
        if self.strategy == "eliminate":
            values = [v for v in values if v not in re.findall(r"\d+", recalled)] or values
        return rng.choice(values)

    def forward(self, input_ids, use_cache=False):
        logits = torch.zeros(*input_ids.shape, len(self.tok))
        for r, row in enumerate(input_ids.tolist()):
            while row and row[-1] == 0:  # right padding
                row.pop()
            text = self.tok.decode(row)
            head, _, _ = text.partition("\n")
            kv = dict(item.split(" ") for item in head.removeprefix("Pairs: ").rstrip(".").split(", "))
            start = text.index("Recall:")
            for m in re.finditer(r" ([a-z]+) (\d+)", text[start:]):
                a = start + m.start(2)  # where the value after this key starts
                guess = self._pick(kv, m.group(1), text[start:a], random.Random(f"{self.seed}:{text[:a]}"))
                enc = self.tok(text[:a] + guess, add_special_tokens=False, return_offsets_mapping=True)
                for t, (_, end) in enumerate(enc["offset_mapping"]):
                    if end > a and t < len(row):
                        logits[r, t - 1, enc["input_ids"][t]] = 1.0
        return SimpleNamespace(logits=logits)


def with_golds(sample) -> str:
    """An MQAR sample's text with every gold value in its slot: the withdrawn format 1's scored text."""
    text, shift = sample.text, 0
    for (a, b), gold in zip(sample.answers, sample.golds):
        text = text[: a + shift] + gold + text[b + shift:]
        shift += len(gold) - (b - a)
    return text


def main() -> None:
    from fusedkv.data import load_tokenizer
    from fusedkv.data.synthetic import TextSample
    from fusedkv.eval.retrieval import mqar_samples, random_copy_floor, score_samples

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="a run's tokenizer (runs/data/DATASET/tokenizer)")
    p.add_argument("--cells", default="2:64,4:64,8:64,16:128", help="PAIRS:LENGTH, comma-separated")
    p.add_argument("--samples", type=int, default=50)
    args = p.parse_args()
    tok = load_tokenizer(args.tokenizer)
    print("| pairs | length | random-copy floor | " + " | ".join(STRATEGIES) + " | eliminate, format 1 |")
    print("|---|---|---|" + "---|" * (len(STRATEGIES) + 1))
    for cell in args.cells.split(","):
        pairs, length = map(int, cell.split(":"))
        samples = mqar_samples(tok, pairs, length, args.samples)
        acc = [score_samples(ScriptedMQAR(tok, s), tok, samples, 64)["accuracy"] for s in STRATEGIES]
        old = [TextSample("mqar", with_golds(s), s.answers, pairs) for s in samples]
        acc.append(score_samples(ScriptedMQAR(tok, "eliminate"), tok, old, 64)["accuracy"])
        print(f"| {pairs} | {length} | {random_copy_floor(pairs):.1f} | " + " | ".join(f"{a:.1f}" for a in acc) + " |",
              flush=True)


if __name__ == "__main__":
    main()
