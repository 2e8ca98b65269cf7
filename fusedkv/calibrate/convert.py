"""`convert_calibrated`: import a checkpoint to a KV-sharing plan with its reconstruction layers fitted to the
original model on calibration text (`passes.py`), instead of starting from the paper's initialisation.

The original is imported as a vanilla fusedkv model first (`fusedkv.convert.convert_checkpoint`, so every family
and format `fusedkv convert` reads works here, into a temporary directory beside the destination that is
removed afterwards); it is the teacher of both passes, and the converted model is built from its weights.
The destination is written whole or not at all, with `calibration.json`: the settings, the calibration
tokens used and each reconstruction layer's measured residuals and errors.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..convert import convert_checkpoint, fusedkv_to_plan_config, model_from_state
from ..data.specs import resolve_source
from ..data.tokenizer import eos_token_id, load_tokenizer
from ..errors import UsageError
from ..model_dirs import check_destination, check_finite_model, write_directory_atomically
from ..plan import CUSTOM, VANILLA, resolve_plan_choice
from ..utils import write_json_atomic
from .passes import REFIT_STAGES, fit_fusion, refit_layers, set_fusion, source_map

REPORT = "calibration.json"
SOURCE_CHOICES = ("plan", "calibrated")


@dataclass(frozen=True)
class Calibration:
    """What `--fusion-init calibrated` fits, on what text. `sources`: "plan" keeps the plan's source layers,
    "calibrated" picks each reconstruction layer's own (written as a custom source map). `stages`: the
    layer-by-layer refits after the fusion fit (empty: the fusion weights alone)."""

    data: str = "builtin"
    tokens: int = 8192
    sources: str = "plan"
    stages: tuple[str, ...] = REFIT_STAGES
    seq_len: int = 1024
    ridge: float = 1e-2

    def __post_init__(self):
        if self.sources not in SOURCE_CHOICES:
            raise UsageError(f"--sources {self.sources}: choose one of {', '.join(SOURCE_CHOICES)}")
        unknown = set(self.stages) - set(REFIT_STAGES)
        if unknown:
            raise UsageError(f"calibration stages {sorted(unknown)}: choose from {', '.join(REFIT_STAGES)}")
        if self.tokens < 2 or self.seq_len < 2:
            raise UsageError(f"--calib-tokens {self.tokens}: calibrate on at least 2 tokens")

    def to_dict(self) -> dict:
        return {**asdict(self), "stages": list(self.stages)}


def calibration_batches(tokenizer, spec: str, tokens: int, seq_len: int) -> list[torch.Tensor]:
    """The first `tokens` tokens of the documents of `spec` (any `--data` spec; EOS between documents), cut
    into [1, seq_len] sequences (the last one shorter is dropped unless it is the only one)."""
    try:
        source = resolve_source(spec)
    except ValueError as e:
        raise UsageError(f"--calib-data: {e}") from e
    eos, ids = eos_token_id(tokenizer), []
    for doc in source:
        ids += tokenizer(doc, add_special_tokens=False, return_attention_mask=False)["input_ids"] + [eos]
        if len(ids) >= tokens:
            break
    ids = ids[:tokens]
    if len(ids) < 2:
        raise UsageError(f"--calib-data {spec}: no text to calibrate on")
    n = min(seq_len, len(ids))
    return [torch.tensor(ids[k: k + n]).unsqueeze(0) for k in range(0, len(ids) - n + 1, n)]


def _progress(enabled: bool):
    from tqdm.auto import tqdm

    return lambda items, desc: tqdm(items, desc=desc, leave=False, disable=not enabled)


def convert_calibrated(src, dst, kv_sharing: str, calibration: Calibration = Calibration(), overwrite: bool = False,
                       progress: bool = True, **overrides):
    """Convert `src` to `kv_sharing` with calibrated reconstruction layers into `dst`; returns (model, report)."""
    src, dst = Path(src), Path(dst)
    check_destination(dst, overwrite, source=src)
    choice = resolve_plan_choice(kv_sharing)
    if choice.sharing == VANILLA or choice.query_heads_per_kv_head is not None:
        raise UsageError(f"--fusion-init calibrated with --plan {kv_sharing}: calibration fits reconstruction "
                         "layers to the original's own K/V heads; choose a sharing plan without +gqa")
    show = _progress(progress)
    started = time.perf_counter()
    dst.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dst.parent, prefix=f".{dst.name}.original-") as tmp:
        original = Path(tmp) / "original"
        teacher = convert_checkpoint(src, original, kv_sharing=VANILLA).eval()
        if teacher.config.kv_lora_rank is not None:
            raise UsageError(f"--fusion-init calibrated: {src} uses multi-head latent attention (MLA), which "
                             "calibration does not fit; use --fusion-init equivalent")
        tokenizer = load_tokenizer(original)
        seq_len = min(calibration.seq_len, teacher.config.max_position_embeddings)
        batches = calibration_batches(tokenizer, calibration.data, calibration.tokens, seq_len)
        saved = teacher.config.to_dict()
        config = fusedkv_to_plan_config(saved, kv_sharing, origin=str(src), **overrides)
        choose = calibration.sources == "calibrated"
        fits = fit_fusion(teacher, config.plan, batches, choose, config.tie_rope_pairs, show)
        if choose:
            config = fusedkv_to_plan_config(saved, CUSTOM, origin=str(src), **overrides,
                                            kv_source_map=source_map(config.plan, fits))
        model = model_from_state(teacher.state_dict(), config, origin=str(src)).eval()
        set_fusion(model, fits)
        if calibration.stages:
            refit_layers(teacher, model, batches, fits, calibration.stages, calibration.ridge, show)
        check_finite_model(model, f"{src} calibrated")
        report = {"settings": calibration.to_dict(), "plan": kv_sharing, "kv_sharing": config.kv_sharing,
                  "tokens": sum(b.numel() for b in batches), "sequences": len(batches),
                  "seconds": round(time.perf_counter() - started, 1), "layers": [f.summary() for f in fits]}
        if choose:
            report["kv_source_map"] = config.kv_source_map

        def write(out: Path) -> None:
            model.save_pretrained(out)
            for f in original.iterdir():  # the tokenizer files the import copied
                if f.is_file() and not f.name.startswith(("model", "config", "fusedkv_remote")):
                    shutil.copy2(f, out / f.name)
            write_json_atomic(out / REPORT, report)

        del teacher
        write_directory_atomically(dst, write, overwrite)
    return model, report
