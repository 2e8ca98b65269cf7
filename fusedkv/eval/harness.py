"""Downstream accuracy through EleutherAI's lm-evaluation-harness (the paper's "avg acc" column).

* :func:`run_lm_eval` evaluates an in-memory Hugging Face-style causal LM (``transformers`` model or
  ``FusedKVForCausalLM``) with its tokenizer, in-process: ``HFLM(pretrained=model, tokenizer=tok)`` +
  ``lm_eval.simple_evaluate(..., task_manager=TaskManager(include_path=...))``.
* :data:`PAPER_TASKS` are the seven benchmarks of the paper (Sec. 4, Table 2), run 5-shot
  (:data:`PAPER_NUM_FEWSHOT`); they download their data from the Hugging Face hub, so they only work
  where the hub is reachable (or its datasets are cached). :func:`paper_average` averages them.
* ``fusedkv/eval/tasks/`` ships three tiny offline tasks (``fkv_sciq_mini``, ``fkv_arc_mini``,
  ``fkv_cloze_mini``, 20 items each) and their group ``fusedkv_local``: smoke tests of the whole
  harness path that need no network. Use ``include_path=local_tasks_dir()`` (the default) or, from the
  CLI, ``lm_eval --include_path $(python -c "import fusedkv.eval as e; print(e.local_tasks_dir())")``.

Local data paths: lm-eval passes ``dataset_kwargs`` unchanged to ``datasets.load_dataset``, which
resolves a relative ``data_files`` path against the *working directory*, not the YAML. The shipped
YAMLs therefore load their jsonl through ``custom_dataset: !function fkv_local.load`` (a loader that lm-eval
imports from the YAML's own folder and that resolves paths against that folder), so they work from
any directory. :func:`materialize_local_tasks` writes equivalent plain ``dataset_path: json`` YAMLs
with absolute ``data_files`` for setups that should not execute task-folder code.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import yaml

PAPER_TASKS: tuple[str, ...] = ("mnli", "sciq", "lambada_openai", "hellaswag", "arc_easy", "arc_challenge",
                                "mmlu")
PAPER_NUM_FEWSHOT = 5
LOCAL_TASKS: tuple[str, ...] = ("fkv_sciq_mini", "fkv_arc_mini", "fkv_cloze_mini")
LOCAL_GROUP = "fusedkv_local"


def local_tasks_dir() -> str:
    """The folder of the shipped local task YAMLs (an lm-eval ``include_path``)."""
    return str(Path(__file__).resolve().parent / "tasks")


class _TaskLoader(yaml.SafeLoader):
    """Reads task YAMLs while keeping lm-eval's ``!function`` tags as plain strings."""


_TaskLoader.add_constructor("!function", lambda loader, node: {"!function": loader.construct_scalar(node)})


def materialize_local_tasks(out_dir: str | Path) -> str:
    """Write the local tasks as plain ``dataset_path: json`` YAMLs with absolute data paths.

    Copies the jsonl files into ``out_dir`` and rewrites each task's loader section to
    ``dataset_kwargs: {data_files: {test: /abs/out_dir/<name>.jsonl}}`` (the form lm-eval documents for
    local data). Returns ``out_dir`` as a string, to be used as lm-eval's ``include_path``.
    """
    src, out = Path(local_tasks_dir()), Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(src.glob("*.yaml")):
        cfg = yaml.load(path.read_text(encoding="utf-8"), Loader=_TaskLoader)
        if "custom_dataset" in cfg:
            data_file = cfg.pop("dataset_kwargs")["data_file"]
            cfg.pop("custom_dataset")
            shutil.copyfile(src / data_file, out / data_file)
            cfg["dataset_path"] = "json"
            cfg["dataset_kwargs"] = {"data_files": {cfg.get("test_split", "test"): str(out / data_file)}}
        if "!function" in repr(cfg):
            raise ValueError(f"{path.name}: cannot materialize a task that still needs task-folder code")
        (out / path.name).write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return str(out)


class _DropCustomDatasetHint(logging.Filter):
    """lm-eval warns on every custom_dataset task that kwargs can be passed via --metadata: irrelevant here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


_HINT_FILTER = _DropCustomDatasetHint()


def _summarize(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``{task_or_group: {metric: value}}`` with lm-eval's ``"acc,none"`` keys reduced to ``"acc"``."""
    out: dict[str, dict[str, float]] = {}
    for name, metrics in results.items():
        row = {}
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if filt == "none" and isinstance(value, (int, float)) and not isinstance(value, bool):
                row[metric] = float(value)
        out[name] = row
    return out


def run_lm_eval(
    model,
    tokenizer,
    tasks: list[str] | tuple[str, ...] = (LOCAL_GROUP,),
    include_path: str | Path | None = None,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    batch_size: int = 1,
    max_length: int | None = None,
    include_defaults: bool | None = None,
    log_samples: bool = False,
    random_seed: int = 0,
    **simple_evaluate_kwargs,
) -> dict[str, Any]:
    """Evaluate ``model`` on lm-eval ``tasks`` in-process and return the results.

    Args:
        model, tokenizer: the LM (already on its device, in eval mode) and its HF tokenizer.
        tasks: lm-eval task or group names (default: the local group ``fusedkv_local``).
        include_path: extra task folder(s); default :func:`local_tasks_dir`.
        num_fewshot: shots for every task (None keeps each task's default, 0 for the local tasks).
        limit: at most this many documents per task (a float in (0, 1) is a fraction).
        batch_size: lm-eval's batch size. max_length: context length lm-eval truncates to (default:
            taken from the model config, as HFLM does).
        include_defaults: also index lm-eval's built-in tasks (slow, a few seconds). None: only when
            some requested task is not one of the local tasks.

    Returns:
        ``{"results": {name: {metric: value}}, "raw": lm-eval's results dict}`` where ``results`` has the
        metrics of every task and group without lm-eval's ``",none"`` filter suffix (e.g. ``acc``,
        ``acc_norm``, ``acc_stderr``, ``perplexity``).
    """
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    tasks = list(tasks)
    include_path = str(include_path) if include_path is not None else local_tasks_dir()
    if include_defaults is None:
        include_defaults = not set(tasks) <= set(LOCAL_TASKS) | {LOCAL_GROUP}
    # HFLM warns that a pre-built model ignores most arguments; that is intended here.
    logging.getLogger("lm_eval.models.huggingface").setLevel(logging.ERROR)
    task_logger = logging.getLogger("lm_eval.api.task")
    if _HINT_FILTER not in task_logger.filters:
        task_logger.addFilter(_HINT_FILTER)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size,
              max_length=max_length)
    task_manager = TaskManager(include_path=include_path, include_defaults=include_defaults)
    raw = simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit, task_manager=task_manager,
                          log_samples=log_samples, random_seed=random_seed, numpy_random_seed=random_seed,
                          torch_random_seed=random_seed, fewshot_random_seed=random_seed,
                          **simple_evaluate_kwargs)
    if raw is None:  # non-zero ranks under torch.distributed get nothing back
        return {"results": {}, "raw": None}
    results = _summarize(raw.get("results", {}))
    results.update(_summarize(raw.get("groups", {})))
    return {"results": results, "raw": raw}


def run_paper_suite(model, tokenizer, limit: int | float | None = None, batch_size: int = 1, **kwargs):
    """The paper's seven benchmarks, 5-shot. Needs the Hugging Face hub (or its datasets cached)."""
    return run_lm_eval(model, tokenizer, tasks=PAPER_TASKS, num_fewshot=PAPER_NUM_FEWSHOT, limit=limit,
                       batch_size=batch_size, include_defaults=True, **kwargs)


def paper_average(results: dict[str, dict[str, float]]) -> float:
    """Mean accuracy (in %) over :data:`PAPER_TASKS` from ``run_lm_eval(...)["results"]``.

    Every task, LAMBADA included, contributes its ``acc`` (the paper reports accuracy for all seven);
    ``mmlu`` is lm-eval's group accuracy over its 57 subjects.
    """
    missing = [t for t in PAPER_TASKS if "acc" not in results.get(t, {})]
    if missing:
        raise KeyError(f"no accuracy for {missing}")
    return 100.0 * sum(results[t]["acc"] for t in PAPER_TASKS) / len(PAPER_TASKS)
