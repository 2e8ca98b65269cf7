"""Evaluation instruments for FusedKV: perplexity / validation loss, RULER-style long-context tasks and
downstream accuracy through lm-evaluation-harness (the columns of the paper's Tables 2 and 16).

All of them take a Hugging Face-style causal LM (``model(input_ids, attention_mask=...).logits`` and
``model.generate``) and its tokenizer. ``harness`` imports ``lm_eval`` only when called, so the rest
works without the ``eval`` extra installed.
"""

from fusedkv.eval.harness import (
    LOCAL_GROUP,
    LOCAL_TASKS,
    PAPER_NUM_FEWSHOT,
    PAPER_TASKS,
    local_tasks_dir,
    materialize_local_tasks,
    paper_average,
    run_lm_eval,
    run_paper_suite,
)
from fusedkv.eval.perplexity import (
    load_wikitext,
    sliding_window_perplexity,
    text_perplexity,
    validation_loss,
    wikitext_perplexity,
)
from fusedkv.eval.ruler import (
    TASKS,
    Sample,
    TaskSpec,
    default_haystack_text,
    format_table,
    generate_predictions,
    generate_task,
    run_ruler,
    score_task,
    string_match_all,
    string_match_part,
)

RULER_TASKS = TASKS

__all__ = [
    "LOCAL_GROUP",
    "LOCAL_TASKS",
    "PAPER_NUM_FEWSHOT",
    "PAPER_TASKS",
    "RULER_TASKS",
    "TASKS",
    "Sample",
    "TaskSpec",
    "default_haystack_text",
    "format_table",
    "generate_predictions",
    "generate_task",
    "load_wikitext",
    "local_tasks_dir",
    "materialize_local_tasks",
    "paper_average",
    "run_lm_eval",
    "run_paper_suite",
    "run_ruler",
    "score_task",
    "sliding_window_perplexity",
    "string_match_all",
    "string_match_part",
    "text_perplexity",
    "validation_loss",
    "wikitext_perplexity",
]
