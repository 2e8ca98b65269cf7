"""RULER-style long-context evaluation (the paper's App. A.7 / Table 16): run a model and score it.

:func:`run_ruler` generates the synthetic prompts of :mod:`fusedkv.data.ruler_tasks` (needle in a
haystack x8, variable tracking, common / frequent words extraction; RULER's QA tasks are not
implemented because their SQuAD / HotpotQA data cannot be fetched here), lets the model continue each
prompt greedily with ``model.generate`` in left-padded batches, and scores the continuations the way
RULER does: ``string_match_all`` (the share of gold strings that appear, case-insensitively, in the
prediction; every task here) or ``string_match_part`` (whether any gold string appears; RULER's QA).
Scores are percentages; :func:`format_table` renders them as markdown (tasks x lengths + average).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict

from fusedkv.data.ruler_haystack import default_haystack_text
from fusedkv.data.ruler_tasks import TASKS, Sample, TaskSpec, generate_task
from fusedkv.utils import model_device as _model_device

__all__ = ["TASKS", "Sample", "TaskSpec", "default_haystack_text", "format_table", "generate_predictions",
           "generate_task", "run_ruler", "score_task", "string_match_all", "string_match_part"]


# ----------------------------------------------------------------------------------------------- scoring
def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Mean over samples of the fraction of gold strings found (case-insensitive substring), x100."""
    if len(preds) != len(refs):
        raise ValueError(f"{len(preds)} predictions for {len(refs)} references")
    if not preds:
        return 0.0
    per = [sum(r.lower() in p.lower() for r in ref) / len(ref) for p, ref in zip(preds, refs)]
    return 100.0 * sum(per) / len(per)


def string_match_part(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Mean over samples of 1 if any gold string is found in the prediction, x100 (RULER's QA metric)."""
    if len(preds) != len(refs):
        raise ValueError(f"{len(preds)} predictions for {len(refs)} references")
    if not preds:
        return 0.0
    per = [max(float(r.lower() in p.lower()) for r in ref) for p, ref in zip(preds, refs)]
    return 100.0 * sum(per) / len(per)


METRICS: dict[str, Callable] = {"all": string_match_all, "part": string_match_part}


def score_task(task: str, preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    return METRICS[TASKS[task].metric](preds, refs)


def generate_predictions(model, tokenizer, prompts: Sequence[str], max_new_tokens: int, batch_size: int = 1,
                         device=None) -> list[str]:
    """Greedy continuations of ``prompts`` (left-padded batches), decoded without special tokens."""
    import torch

    device = device if device is not None else _model_device(model)
    saved_side, saved_pad = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side = "left"  # decoder-only generation must see the prompt end at the last column
    if tokenizer.pad_token is None:  # padding needs some token; masked out, so eos is as good as any
        tokenizer.pad_token = tokenizer.eos_token
    pad_id = tokenizer.pad_token_id
    order = sorted(range(len(prompts)), key=lambda j: len(prompts[j]), reverse=True)  # less padding
    preds: list[str] = [""] * len(prompts)
    try:
        for b in range(0, len(order), batch_size):
            idx = order[b : b + batch_size]
            enc = tokenizer([prompts[j] for j in idx], return_tensors="pt", padding=True)
            with torch.no_grad():
                out = model.generate(input_ids=enc["input_ids"].to(device),
                                     attention_mask=enc["attention_mask"].to(device),
                                     max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                     pad_token_id=pad_id)
            new = out[:, enc["input_ids"].shape[1] :]
            for j, row in zip(idx, new):
                preds[j] = tokenizer.decode(row, skip_special_tokens=True).strip()
    finally:
        tokenizer.padding_side = saved_side
        if saved_pad is None:
            tokenizer.pad_token = None
    return preds


def run_ruler(
    model,
    tokenizer,
    tasks: Sequence[str] | None = None,
    lengths: Sequence[int] = (4096,),
    num_samples: int = 10,
    batch_size: int = 1,
    max_new_tokens: int | dict[str, int] | None = None,
    seed: int = 0,
    haystack_text: str | None = None,
    return_samples: bool = False,
) -> dict:
    """Generate, run greedily and score RULER tasks at each length.

    ``max_new_tokens``: None -> each task's RULER budget; an int for all tasks; or a per-task dict.
    Returns ``{"scores": {task: {length: score}}, "average": {length: mean over tasks}, "overall": float,
    "tasks", "lengths", "num_samples"}`` (scores in [0, 100]); with ``return_samples`` also the
    samples and predictions under ``"samples"``.
    """
    tasks = list(tasks) if tasks is not None else list(TASKS)
    scores: dict[str, dict[int, float]] = {t: {} for t in tasks}
    records = []
    was_training = getattr(model, "training", False)
    model.eval()
    try:
        for length in lengths:
            for t in tasks:
                budget = max_new_tokens.get(t, TASKS[t].max_new_tokens) if isinstance(max_new_tokens, dict) \
                    else (max_new_tokens or TASKS[t].max_new_tokens)
                # As in RULER, the length counts the answer budget: prompt + generation fit in `length`.
                samples = generate_task(t, tokenizer, length - budget, num_samples, seed=seed,
                                        haystack_text=haystack_text)
                preds = generate_predictions(model, tokenizer, [s.input for s in samples], budget, batch_size)
                scores[t][length] = score_task(t, preds, [s.outputs for s in samples])
                if return_samples:
                    records += [dict(asdict(s), pred=p) for s, p in zip(samples, preds)]
    finally:
        model.train(was_training)
    average = {L: sum(scores[t][L] for t in tasks) / len(tasks) for L in lengths}
    out = {"tasks": tasks, "lengths": list(lengths), "num_samples": num_samples, "scores": scores,
           "average": average, "overall": sum(average.values()) / len(average)}
    if return_samples:
        out["samples"] = records
    return out


def format_table(results: dict) -> str:
    """Markdown table: one row per task, one column per length, plus the average row."""
    lengths = results["lengths"]
    lines = ["| task | " + " | ".join(str(L) for L in lengths) + " |",
             "|---|" + "---:|" * len(lengths)]
    for t in results["tasks"]:
        lines.append(f"| {t} | " + " | ".join(f"{results['scores'][t][L]:.2f}" for L in lengths) + " |")
    lines.append("| **average** | " + " | ".join(f"{results['average'][L]:.2f}" for L in lengths) + " |")
    return "\n".join(lines)
