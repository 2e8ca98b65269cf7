"""Verdicts on the paper's claims: one rule, one vocabulary, Holm's correction over the tests run.

The rule (written out once for readers in docs/evidence.md, "How verdicts are given"): a claim of the paper
is a direction, the sign of `run - reference` it reports (Table 2: FusedKV's validation loss below
vanilla's; Table 16: Lite's RULER score below vanilla's). Our measurement is that difference paired seed
by seed; its two-sided paired t test on seeds - 1 degrees of freedom gives p. Then

* **reproduced**: same direction, p < 0.05;
* **same direction, inconclusive**: same direction, p >= 0.05;
* **opposite direction, inconclusive**: the opposite direction, p >= 0.05 (the issue's list names no
  word for this case; folding it into either neighbour would say more than the data);
* **not reproduced**: the opposite direction, p < 0.05;
* **not testable here**: the setting cannot measure the claim (the reason is given);
* one seed gives a direction and no test: "same direction, inconclusive" or "opposite direction,
  inconclusive", never more;
* **beyond the paper**: the paper makes no claim about this comparison.

The verdict uses the per-test p. Because many tests are run, the table also gives Holm's step-down
adjusted p over the tests of the family (the rows with a p) and the verdict that p would give; a
"reproduced" that does not survive Holm is reported as such, not dropped.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

REPRODUCED = "reproduced"
SAME_INCONCLUSIVE = "same direction, inconclusive"
OPPOSITE_INCONCLUSIVE = "opposite direction, inconclusive"
NOT_REPRODUCED = "not reproduced"
NOT_TESTABLE = "not testable here"
BEYOND = "beyond the paper"
VERDICTS = (REPRODUCED, SAME_INCONCLUSIVE, OPPOSITE_INCONCLUSIVE, NOT_REPRODUCED, NOT_TESTABLE, BEYOND)
ALPHA = 0.05
LONGEST_LEARNED = "longest learned"  # a claim's `length:` the longest at which its baseline learned the lookup


def t_two_sided_p(t: float, df: int) -> float:
    """Two-sided p of Student's t with `df` (integer) degrees of freedom: the closed forms of Abramowitz and
    Stegun 26.7.3-4 (exact; no scipy)."""
    if df < 1:
        raise ValueError(f"df={df}: need at least one degree of freedom (two seeds)")
    if math.isinf(t):
        return 0.0
    theta = math.atan(abs(t) / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2 == 1:  # A = (2/pi) (theta + sin cos (1 + 2/3 cos^2 + ... )), the sum empty for df = 1
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        inside = 2 / math.pi * (theta + s * math.cos(theta) * total)
    else:  # A = sin (1 + 1/2 cos^2 + 1.3/(2.4) cos^4 + ...)
        term, total = 1.0, 1.0
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        inside = s * total
    return min(1.0, max(0.0, 1.0 - inside))


@dataclass(frozen=True)
class Paired:
    """A paired difference over seeds: its values, mean, sample std, t and two-sided p."""

    diffs: tuple[float, ...]
    mean: float
    std: float
    t: float
    p: float


def paired_test(diffs: Sequence[float]) -> Paired:
    """The paired t test of `diffs` (run - reference, one per seed; at least two)."""
    d = tuple(float(x) for x in diffs)
    if len(d) < 2:
        raise ValueError(f"{len(d)} paired value(s): a paired test needs at least two seeds")
    mean, sd = statistics.mean(d), statistics.stdev(d)
    if sd == 0:
        t = 0.0 if mean == 0 else math.copysign(math.inf, mean)
    else:
        t = mean / (sd / math.sqrt(len(d)))
    return Paired(d, mean, sd, t, 1.0 if t == 0 else t_two_sided_p(t, len(d) - 1))


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values (None entries are not tests and stay None): sorted ascending,
    p_(i) * (m - i + 1), made monotone, capped at 1."""
    tested = sorted((p, i) for i, p in enumerate(pvalues) if p is not None)
    m = len(tested)
    out: list[float | None] = [None] * len(pvalues)
    running = 0.0
    for rank, (p, i) in enumerate(tested):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out


def verdict(mean: float | None, p: float | None, paper_sign: int | None, not_testable: str | None = None,
            alpha: float = ALPHA) -> str:
    """The verdict of one comparison: `paper_sign` is the sign the paper reports for `run - reference`
    (None: the paper makes no claim); `not_testable` a reason the setting cannot measure it."""
    if not_testable:
        return NOT_TESTABLE
    if paper_sign is None:
        return BEYOND
    if paper_sign not in (-1, 1):
        raise ValueError(f"paper_sign={paper_sign}: the paper's direction is -1 or +1")
    if mean is None:
        raise ValueError("a testable claim needs a paired mean")
    same = mean * paper_sign > 0
    if p is not None and p < alpha:  # p None: one seed, a direction without a test
        return REPRODUCED if same else NOT_REPRODUCED
    return SAME_INCONCLUSIVE if same else OPPOSITE_INCONCLUSIVE


@dataclass
class Claim:
    """One row of a verdict table: a comparison, the paper's value for it (its sign is the claim; None:
    no claim), where the paper says it, our per-seed differences, and why it cannot be tested, if so."""

    label: str
    paper: float | None
    source: str = ""
    diffs: Sequence[float] = ()
    not_testable: str | None = None
    digits: int = 4


def verdict_rows(claims: Sequence[Claim]) -> list[dict]:
    """Each claim's test, verdict, Holm-adjusted p (over the claims with a p) and verdict after Holm."""
    tests = [paired_test(c.diffs) if len(c.diffs) >= 2 else None for c in claims]
    p = [t.p if t is not None and not c.not_testable and c.paper is not None else None
         for c, t in zip(claims, tests)]
    adjusted = holm(p)
    rows = []
    for c, t, pi, adj in zip(claims, tests, p, adjusted):
        if c.paper == 0:
            raise ValueError(f"{c.label}: the paper's value 0 is no direction; give its sign or no claim (null)")
        sign = None if c.paper is None else (1 if c.paper > 0 else -1)
        mean = t.mean if t is not None else (float(c.diffs[0]) if len(c.diffs) == 1 else None)
        reason = c.not_testable or (None if mean is not None or sign is None else "not measured")
        rows.append({"claim": c, "test": t, "mean": mean, "p": pi, "holm": adj,
                     "verdict": verdict(mean, pi, sign, reason),
                     "verdict_holm": verdict(mean, adj, sign, reason), "reason": reason})
    return rows


def verdict_table(claims: Sequence[Claim]) -> str:
    """Markdown: comparison, the paper's value, our paired difference per seed and mean ± std, t, p, the
    verdict, Holm's p and the verdict after it; a closing line with the number of tests."""
    rows = verdict_rows(claims)
    m = sum(r["p"] is not None for r in rows)
    lines = [f"| comparison | paper | per seed | mean ± std | t | p | verdict | Holm p ({m} tests) | after Holm |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, t = r["claim"], r["test"]
        k = c.digits
        paper = "no claim" if c.paper is None else f"{c.paper:+g}" + (f" ({c.source})" if c.source else "")
        seeds = ", ".join(f"{float(x):+.{k}f}" for x in c.diffs) or "–"
        spread = f"{t.mean:+.{k}f} ± {t.std:.{k}f}" if t else ("one seed, no test" if r["mean"] is not None else "–")
        tcol = f"{t.t:+.1f}" if t else "–"
        pcol = "–" if r["p"] is None else f"{r['p']:.3f}"
        hcol = "–" if r["holm"] is None else f"{r['holm']:.3f}"
        v = r["verdict"] + (f" ({r['reason']})" if r["verdict"] == NOT_TESTABLE else "")
        lines.append(f"| {c.label} | {paper} | {seeds} | {spread} | {tcol} | {pcol} | {v} | {hcol} | "
                     f"{r['verdict_holm'] if r['p'] is not None else '–'} |")
    rule = ("Verdict rule (docs/evidence.md): the sign of the paper's value is its claim; our difference is "
            "paired over seeds, two-sided t test; reproduced = same sign, p < 0.05; not reproduced = opposite "
            f"sign, p < 0.05; otherwise inconclusive. {m} tests in this table; Holm's step-down correction over "
            "them in the last two columns.")
    return "\n".join(lines) + "\n\n" + rule


# ---- claims of an experiment file ---------------------------------------------------------------------------
def check_claims(spec: dict) -> None:
    """The file's `claims:` checked when it is read, not after hours of training: ValueError naming the
    entry. A pair naming runs the file does not list is allowed (a file that `extends` another with a
    subset of its runs keeps its parent's claims; `experiment_claims` leaves those out)."""
    for i, entry in enumerate(spec.get("claims") or []):
        where = f"claims entry {i + 1} ({entry!r})"
        if not isinstance(entry, dict) or not (isinstance(entry.get("pair"), list) and len(entry["pair"]) == 2):
            raise ValueError(f"{where}: needs pair: [RUN, REFERENCE]")
        unknown = set(entry) - {"pair", "metric", "paper", "source", "not_testable", "gate", "length"}
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}")
        if entry.get("metric", "val_loss") not in ("val_loss", "mqar"):
            raise ValueError(f"{where}: metric must be val_loss or mqar")
        length = entry.get("length")
        if "length" in entry and (entry.get("metric") != "mqar" or (length != LONGEST_LEARNED and (
                isinstance(length, bool) or not isinstance(length, int) or length < 1))):
            raise ValueError(f"{where}: length is for metric: mqar, a positive number of tokens or "
                             f"{LONGEST_LEARNED!r}")
        paper = entry.get("paper")
        if paper is not None and (isinstance(paper, bool) or not isinstance(paper, (int, float)) or paper == 0):
            raise ValueError(f"{where}: paper must be the paper's nonzero difference (its sign is the claim), "
                             "or null for no claim")


def experiment_claims(spec: dict, results: list[dict]) -> list[Claim]:
    """The `claims:` of an experiment file, measured on `results` (a claim whose runs did not finish is
    left out). Each entry: `{pair: [RUN, REFERENCE], metric: val_loss | mqar, paper: VALUE (or null: no
    claim), source: "Table 2", not_testable: REASON, gate: RUN, length: TOKENS}`.

    `metric: mqar` is the MQAR score at `length`: by default the longest length both runs were scored at;
    `longest learned` is the longest at which every seed of `gate` learned the lookup, chosen from the
    baseline alone, never from the plans' scores. Such a claim is not testable while any seed of `gate`
    (default the reference) is not above the random-copy floor at that length
    (`fusedkv.eval.retrieval.learned`): the baseline must retrieve at the length compared, or there is no
    retrieval for a plan to lose (Table 16 compares plans where vanilla scores 49%)."""
    from ..eval.retrieval import mqar_score

    names = {r["name"] for r in results}
    out = []
    for entry in spec.get("claims") or []:
        run, ref = entry["pair"]
        if run not in names or ref not in names:
            continue
        metric = entry.get("metric", "val_loss")
        by_seed = {(r["name"], r["seed"]): r for r in results}
        seeds = sorted(s for (n, s) in by_seed if n == run and (ref, s) in by_seed)
        reason = entry.get("not_testable")
        if metric == "val_loss":
            diffs = [by_seed[run, s]["val_loss"] - by_seed[ref, s]["val_loss"] for s in seeds]
            digits = 4
        elif metric == "mqar":
            from ..eval.retrieval import learned

            scored = [s for s in seeds if by_seed[run, s].get("retrieval") and by_seed[ref, s].get("retrieval")]
            common = [set(map(int, by_seed[run, s]["retrieval"]["lengths"]))
                      & set(map(int, by_seed[ref, s]["retrieval"]["lengths"])) for s in scored]
            both = set.intersection(*common) if common else set()
            gate = entry.get("gate", ref)  # the run every seed of which must have learned the lookup
            gated = [by_seed[gate, s]["retrieval"] for s in scored if (gate, s) in by_seed]
            length = entry.get("length", max(both) if both else None)
            if length == LONGEST_LEARNED:
                where = [L for L in both if len(gated) == len(scored) and all(learned(r, L) for r in gated)]
                length = max(where) if where else min(both) if both else None
            if length is not None and length not in both:
                continue  # not scored at that length in every seed (a run of a shorter context)
            diffs = [] if length is None else [mqar_score(by_seed[run, s]["retrieval"], length)
                                               - mqar_score(by_seed[ref, s]["retrieval"], length) for s in scored]
            learnt = sum(learned(r, length) for r in gated) if length is not None else 0
            if not reason and not (len(gated) == len(scored) and learnt == len(gated)):
                reason = (f"{gate} has not learned the lookup at {length} tokens in every seed ({learnt} of "
                          f"{len(gated)} above the random-copy floor)")
            digits = 1
        else:
            raise ValueError(f"claims: metric {metric!r}: choose val_loss or mqar")
        label = f"{run} − {ref}"
        if metric == "mqar":
            label += f" (MQAR score at {length}" + (", the longest length the baseline learned" if
                                                     entry.get("length") == LONGEST_LEARNED else "") + ")"
        out.append(Claim(label, entry.get("paper"), entry.get("source", ""), diffs, reason, digits))
    return out


def retrieval_floors(results: list[dict]) -> str:
    """Markdown beside a retrieval report: the floors of the MQAR score (accuracy averaged over the pair
    counts) at each length, and per run how many seeds learned the lookup (every pair count at the
    shortest length significantly above its random-copy floor: `fusedkv.eval.retrieval.learned`)."""
    from ..eval.retrieval import learned, random_copy_floor, uniform_floor

    scored = [r for r in results if r.get("retrieval")]
    if not scored:
        return ""
    floors: dict[int, list[float]] = {}
    for r in scored:
        for p, row in r["retrieval"]["mqar"].items():
            for length, acc in row.items():
                if acc is not None:
                    floors.setdefault(int(length), [])
                    if random_copy_floor(int(p)) not in floors[int(length)]:
                        floors[int(length)].append(random_copy_floor(int(p)))
    lengths = sorted(floors)
    lines = ["| floor of the MQAR score | " + " | ".join(str(L) for L in lengths) + " |",
             "|---|" + "---:|" * len(lengths),
             "| random copy (mean of 100/P over the pair counts scored) | "
             + " | ".join(f"{statistics.mean(floors[L]):.1f}" for L in lengths) + " |",
             "| uniform guess over the 90 values | " + " | ".join(f"{uniform_floor():.1f}" for _ in lengths) + " |"]
    names = list(dict.fromkeys(r["name"] for r in scored))
    learnt = [f"{n} {sum(learned(r['retrieval']) for r in scored if r['name'] == n)}/"
              f"{sum(r['name'] == n for r in scored)}" for n in names]
    return ("\n".join(lines) + "\n\nSeeds that learned the lookup (every pair count at the shortest length "
            "above its random-copy floor, one-sided exact binomial test, p < 0.05): " + ", ".join(learnt) + ".")


def claims_from_json(path) -> list[Claim]:
    """Claims recorded in a JSON file: a list of {label, paper, source, diffs, not_testable, digits}."""
    import json
    from pathlib import Path

    return [Claim(**entry) for entry in json.loads(Path(path).read_text())]


if __name__ == "__main__":  # python -m fusedkv.experiments.verdicts CLAIMS.json: the verdict table of a record
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m fusedkv.experiments.verdicts CLAIMS.json")
    print(verdict_table(claims_from_json(sys.argv[1])))
