"""A pretrained model's cache options side by side: quality against KV bytes per token.

An experiment file with a `source:` (a pretrained model: a transformers checkpoint directory or a GGUF file)
is run here by `fusedkv compare` instead of the training runner. It names

    models:  the teacher (the source, imported with --plan vanilla) and half-cache plans made from it by
             `fusedkv uptrain` (plan, --fusion-init, training settings): one resumable uptraining run each,
             or by `fusedkv convert` alone (`train: false`: the conversion before any training);
    rows:    a model read through a KV cache kind: f32, bf16 (a 16-bit cache), fp8 (vLLM's e4m3 cache,
             `fusedkv.quant.fp8`), kivi4 / kivi2 (`fusedkv.quant.kivi`), or PLAN+kivi4 combinations;
    texts:   held-out texts (data specs or files), each scored on its first `windows` windows of `window`
             tokens, token by token through the row's cache (`fusedkv.quant.scoring.DecodeScorer`: what
             decoding sees; a full-sequence forward would never read a quantised cache).

Every piece is cached in OUT and keyed by what it computes, so the experiment runs in pieces (`--runs`
names rows; a row runs the model it needs), a killed uptraining resumes (it is `fusedkv uptrain`), and a
finished row is never scored twice. The table (perplexity per text, its ratio to the teacher's with a 95%
paired bootstrap interval over the windows, KV bytes per token and per cent of the bf16 teacher's) goes to
OUT/results.md and results.json; quality against bytes to OUT/quality_vs_bytes.png; each uptrained model's
validation loss against training tokens to OUT/recovery.png (`fusedkv.experiments.pretrained_report`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..errors import UsageError
from ..utils import write_json_atomic

CACHE_KINDS = ("f32", "bf16", "fp8", "kivi4", "kivi2")
TEACHER = "teacher"


# ---- the file ---------------------------------------------------------------------------------------------
def is_pretrained(spec: dict) -> bool:
    return "source" in spec


def check(spec: dict, origin: str) -> None:
    """Every field checked before anything runs (one line naming the field)."""
    for key in ("models", "rows", "texts"):
        if not isinstance(spec.get(key), list) or not spec[key]:
            raise UsageError(f"{origin}: '{key}' must be a non-empty list")
    names = [m.get("name") for m in spec["models"]]
    if TEACHER not in names:
        raise UsageError(f"{origin}: models must include {TEACHER!r} (the source itself)")
    if len(set(names)) != len(names):
        raise UsageError(f"{origin}: model names must be unique, got {names}")
    for m in spec["models"]:
        if m["name"] != TEACHER and "plan" not in m:
            raise UsageError(f"{origin}: model {m['name']!r} needs a 'plan' (it is uptrained from the teacher)")
    rows = [row_name(r) for r in spec["rows"]]
    if len(set(rows)) != len(rows):
        raise UsageError(f"{origin}: rows repeat: {rows}")
    for r in spec["rows"]:
        if r.get("model") not in names:
            raise UsageError(f"{origin}: row {r} reads model {r.get('model')!r}, not one of {names}")
        if r.get("cache") not in CACHE_KINDS:
            raise UsageError(f"{origin}: row {r}: cache must be one of {', '.join(CACHE_KINDS)}")


def row_name(row: dict) -> str:
    return row.get("name") or f"{row['model']} {row['cache']}"


# ---- models ---------------------------------------------------------------------------------------------
def source_checkpoint(source: str, out: Path) -> Path:
    """The source as a transformers checkpoint directory (a GGUF file is dequantised once into OUT)."""
    path = Path(os.path.expanduser(source))
    if path.is_dir():
        return path
    if not path.is_file():
        raise UsageError(f"source {source}: no such file or directory; pass --source PATH (a checkpoint directory "
                         "or a GGUF file; README, 'A real model')")
    from ..convert.sources import source_directory

    return source_directory(path, out / "source")


def teacher_dir(src: Path, out: Path) -> Path:
    """The source imported with --plan vanilla (fusedkv's model of the same function: cacheable by every kind)."""
    target = out / "models" / TEACHER
    if not (target / "config.json").is_file():
        from ..convert import convert_checkpoint

        convert_checkpoint(src, target, overwrite=True)
    return target


def uptrain_command(src: Path, model: dict, out: Path) -> list[str]:
    """`fusedkv uptrain` for one half-cache model (its options as the file gives them)."""
    cmd = [sys.executable, "-m", "fusedkv.cli", "uptrain", str(src), str(out), "--plan", model["plan"], "--quiet"]
    for key in ("fusion_init", "data", "max_steps", "seed", "distill_alpha", "distill_temperature"):
        if key in model:
            cmd += [f"--{key.replace('_', '-')}", str(model[key])]
    for key, value in sorted((model.get("set") or {}).items()):
        cmd += ["--set", f"{key}={value}"]
    cmd += [str(a) for a in model.get("args", [])]
    return cmd


def convert_command(src: Path, model: dict, out: Path) -> list[str]:
    """`fusedkv convert` for a model the file does not train (`train: false`): the conversion as it starts."""
    cmd = [sys.executable, "-m", "fusedkv.cli", "convert", str(src), str(out), "--plan", model["plan"], "--overwrite"]
    for key in ("fusion_init", "calib_data", "calib_tokens", "sources"):
        if key in model:
            cmd += [f"--{key.replace('_', '-')}", str(model[key])]
    return cmd


def model_dir(name: str, spec: dict, src: Path, out: Path, progress: bool) -> Path:
    """The model `name` ready to score: the teacher's import, a conversion (`train: false`), or its uptrained
    model (trained now, resuming a killed run, when not finished)."""
    if name == TEACHER:
        return teacher_dir(src, out)
    model = next(m for m in spec["models"] if m["name"] == name)
    run = out / "models" / name
    if model.get("train") is False:
        if not (run / "config.json").is_file():
            cmd = convert_command(src, model, run)
            if progress:
                print(f"converting {name}: {' '.join(cmd[1:])}", flush=True)
            if subprocess.run(cmd).returncode != 0:
                raise UsageError(f"converting {name!r} failed; see the message above")
        return run
    final = run / "train" / "final"
    if (run / "report.json").is_file() and final.is_dir():
        return final
    cmd = uptrain_command(src, model, run)
    if progress:
        print(f"uptraining {name}: {' '.join(cmd[1:])}", flush=True)
    done = subprocess.run(cmd)
    if done.returncode != 0:
        raise UsageError(f"uptraining {name!r} stopped (exit {done.returncode}); its run is in {run}: re-run the "
                         "same command to continue it")
    return final


# ---- scoring --------------------------------------------------------------------------------------------
UNQUANTISED = ("f32", "bf16")


def cache_factory(kind: str):
    """config -> a cache of this kind for one batch of windows (None: the full-sequence forward, f32)."""
    if kind == "f32":
        return None
    if kind == "bf16":
        from ..cache import StaticKVCache

        return lambda cfg, batch, length: StaticKVCache(cfg, batch, length, torch.bfloat16)
    if kind == "fp8":
        from ..quant.fp8 import FP8Cache

        return lambda cfg, batch, length: FP8Cache(cfg)
    from ..quant import KIVICache

    bits = int(kind.removeprefix("kivi"))
    return lambda cfg, batch, length: KIVICache(cfg, bits)


def kv_bytes_per_token(config, kind: str) -> float:
    """Bytes the cache holds per token over all layers (KIVI: its packed codes and per-group scales and zero
    points, without the full-precision residual window, which does not grow with the context)."""
    per_elem = {"f32": 4, "bf16": 2, "fp8": 1}
    if kind in per_elem:
        return config.kv_cache_bytes_per_token(per_elem[kind])
    from ..quant import default_group_size, kivi_bytes_per_token

    bits = int(kind.removeprefix("kivi"))
    per_head = kivi_bytes_per_token(config.head_dim, bits, default_group_size(config.head_dim))
    return len(config.plan.storage_layers) * config.num_key_value_heads * per_head


def text_windows(text: str, tokenizer_dir: Path, window: int, windows: int) -> torch.Tensor:
    """[windows, window + 1] token ids: the first windows of the text (a data spec or a file)."""
    from transformers import AutoTokenizer

    from ..data.specs import resolve_source

    source = resolve_source(text)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids: list[int] = []
    for doc in source:
        ids += tok(doc)["input_ids"]
        if len(ids) > windows * window + 1:
            break
    n = min(windows, (len(ids) - 1) // window)
    if n < 1:
        raise UsageError(f"text {text!r}: {len(ids)} tokens, fewer than one window of {window}")
    return torch.tensor([ids[i * window:(i + 1) * window + 1] for i in range(n)])


@torch.inference_mode()
def score(model, kind: str, ids: torch.Tensor, batch: int = 8) -> list[float]:
    """Each window's mean next-token loss (nats), read through a cache of `kind` (windows of equal length:
    their mean is the text's loss)."""
    from ..model.loss import lm_loss
    from ..quant.scoring import DecodeScorer

    make = cache_factory(kind)
    losses = []
    for i in range(0, ids.shape[0], batch):
        x, y = ids[i:i + batch, :-1], ids[i:i + batch, 1:]
        if make is None:
            logits = model(x).logits
        else:
            logits = DecodeScorer(model, lambda cfg, b=x.shape[0], t=x.shape[1]: make(cfg, b, t))(x).logits
        losses += [lm_loss(logits[j:j + 1], y[j:j + 1]).item() for j in range(x.shape[0])]
    return losses


def row_file(out: Path, name: str) -> Path:
    """Where a row's scores are cached: OUT/rows/NAME.json (spaces and '+' made file-name safe)."""
    return out / "rows" / f"{name.replace(' ', '_').replace('+', 'plus')}.json"


def key_of(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def row_result(row: dict, spec: dict, src: Path, out: Path, progress: bool) -> dict:
    """One row's scores, cached in OUT/rows/NAME.json under a key of everything it depends on."""
    from ..model import FusedKVForCausalLM

    name = row_name(row)
    model_spec = next(m for m in spec["models"] if m["name"] == row["model"])
    key = key_of(model_spec, row["cache"], spec["texts"], spec.get("window", 512), spec.get("windows", 8),
                 str(src))
    path = row_file(out, name)
    if path.is_file() and json.loads(path.read_text()).get("key") == key:
        return json.loads(path.read_text())
    directory = model_dir(row["model"], spec, src, out, progress)
    model = FusedKVForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    t0 = time.time()
    losses, windows = {}, {}
    for text in spec["texts"]:
        ids = text_windows(text, directory, spec.get("window", 512), spec.get("windows", 8))
        windows[text] = score(model, row["cache"], ids)
        losses[text] = sum(windows[text]) / len(windows[text])
        if progress:
            print(f"  {name}: {text} ppl {math.exp(losses[text]):.3f}", flush=True)
    result = dict(key=key, name=name, model=row["model"], cache=row["cache"], plan=model.config.kv_sharing,
                  checkpoint=str(directory), loss=losses, window_loss=windows,
                  ppl={t: math.exp(v) for t, v in losses.items()},
                  kv_bytes_per_token=kv_bytes_per_token(model.config, row["cache"]), seconds=time.time() - t0,
                  date=time.strftime("%Y-%m-%d"), curve=_curve(out / "models" / row["model"]))
    write_json_atomic(path, result)
    return result


def _curve(run: Path) -> list:
    """(training tokens, validation loss) of an uptraining run (its report), [] for the teacher."""
    report = run / "report.json"
    if not report.is_file():
        return []
    saved = json.loads(report.read_text())
    start = saved.get("train", {}).get("init_val_loss")
    curve = [(r["tokens"], r["val_loss"]) for r in saved.get("val_curve") or [] if r.get("val_loss") is not None]
    return ([(0, start)] if start is not None else []) + curve


def model_tasks(model: str, directory: Path, spec: dict, src: Path, out: Path, task_limit: int,
                compute: bool) -> dict | None:
    """A model's accuracy on the local lm-eval tasks, cached in OUT/tasks/MODEL.json. lm-eval scores a
    full-sequence forward, which reads no cache: one score per model, whatever rows read it through."""
    from .runner import _task_scores

    path = out / "tasks" / f"{model}.json"
    key = key_of(next(m for m in spec["models"] if m["name"] == model), str(src), task_limit)
    if path.is_file() and json.loads(path.read_text()).get("key") == key:
        return json.loads(path.read_text())["tasks"]
    if not compute:
        return None
    from ..model import FusedKVForCausalLM

    scores = _task_scores(FusedKVForCausalLM.from_pretrained(directory, dtype=torch.float32).eval(), directory,
                          task_limit)
    write_json_atomic(path, {"key": key, "model": model, "task_limit": task_limit, "tasks": scores})
    return scores


# ---- the experiment ---------------------------------------------------------------------------------------
def run(spec: dict, out: Path, source: str | None, only: list[str] | None, finished_only: bool,
        progress: bool = True, task_limit: int = 0) -> list[dict]:
    check(spec, spec.get("name", "experiment"))
    out.mkdir(parents=True, exist_ok=True)
    src = source_checkpoint(source or spec["source"], out)
    rows = [r for r in spec["rows"] if not only or row_name(r) in only or r["model"] in only]
    if only and not rows:
        raise UsageError(f"--runs {','.join(only)}: no row or model of that name; rows: "
                         f"{', '.join(row_name(r) for r in spec['rows'])}")
    results = []
    for row in rows:
        name = row_name(row)
        cached = row_file(out, name)
        if finished_only:
            if cached.is_file():
                results.append(json.loads(cached.read_text()))
            elif progress:
                print(f"not finished: {name}", flush=True)
            continue
        results.append(row_result(row, spec, src, out, progress))
    for r in results:  # on the rows that read the model unquantised (the tasks read no cache)
        if task_limit and r["cache"] in UNQUANTISED:
            tasks = model_tasks(r["model"], Path(r["checkpoint"]), spec, src, out, task_limit,
                                compute=not finished_only)
            if tasks:
                r["tasks"] = tasks
    return results
