"""`TrainConfig`: one dataclass that says everything a training run needs; presets are YAML files.

A run is fully described by a `TrainConfig`: the model (a preset's dimensions plus overrides of any
`FusedKVConfig` field), the data (source spec, tokenizer vocabulary, prepared-data directory), the
batch and token budget, the optimiser (the paper's AdamW recipe), the runtime (device, dtype, compile,
activation checkpointing, DDP/FSDP2) and the bookkeeping (evaluation, checkpoints, output directory,
resume). The resolved config is saved with every checkpoint, so a run can always be reproduced or
resumed from what is on disk.

Values come in layers, later layers winning (`resolve_config`): the preset, a checkpoint's saved
config (resume), a YAML file, `--set key=value` overrides (`parse_overrides`, the one parser) and
explicit keyword arguments / CLI flags. Fields left at `None` are filled from the preset by
`__post_init__`, so `TrainConfig(preset="nano", kv_sharing="vanilla")` is complete on its own.

One name per field, the model config's: `kv_sharing` and `rope_theta` (as in `FusedKVConfig`) sit at
the top level because the run decides them (and `init_from` may keep or change them); every other
`FusedKVConfig` field goes under `model`. `plan` (what users type: `--plan`) and the names that files
written before this version use (`rope_base`) are read as `kv_sharing` / `rope_theta`. Every value is
type-checked and every number range-checked when the config is built: a bad `--set` fails with a
ValueError naming the key before anything is read or written.

Presets (model sizes and their recipes) are YAML files, loaded by `fusedkv.train.recipes`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..config import FusedKVConfig, field_types
from ..plan import CUSTOM, DEFAULT_PLAN, PlanChoice, resolve_plan_choice
from .recipes import PRESET_NAMES, PRESETS
from .values import coerce

DISTRIBUTED_MODES = ("none", "ddp", "fsdp")
DTYPES = ("auto", "float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")

# Names read as another field: the CLI flag's name and the names of configs saved before this version.
ALIASES = {"plan": "kv_sharing", "rope_base": "rope_theta"}

# FusedKVConfig fields that TrainConfig holds at the top level under the same name.
_TOP_LEVEL_MODEL_FIELDS = ("vocab_size", "kv_sharing", "rope_theta")
MODEL_FIELDS = tuple(name for name in field_types() if name not in (*_TOP_LEVEL_MODEL_FIELDS, "rope_parameters"))


@dataclass
class TrainConfig:
    """Everything a training run needs. `None` means "take it from the preset"."""

    # ---- model ---------------------------------------------------------------------------------
    preset: str = "tiny"  # one of PRESET_NAMES: model dims + the training recipe that goes with them
    kv_sharing: str | None = None  # the plan (`--plan`); None: "fusedkv" (or the --init-from checkpoint's)
    model: dict = field(default_factory=dict)  # FusedKVConfig overrides on top of the preset's dims
    rope_theta: float | None = None  # RoPE base (paper: 10,000; 50,000 / 500,000 for long context)
    init_from: str | None = None  # start from a saved model directory's weights (save_pretrained)
    # Uptraining (fusedkv.train.distill): the loss becomes alpha * T^2 * KL(teacher || student)
    # + (1 - alpha) * LM [+ hidden_weight * hidden-state MSE], the teacher a saved full-cache model.
    distill_from: str | None = None
    distill_alpha: float = 0.5
    distill_temperature: float = 1.0
    distill_hidden_weight: float = 0.0
    # Faster uptraining (docs/uptraining.md has the measurements). freeze_lower_layers: the embedding (a tied
    # head with it) and every layer below the first reconstruction layer keep their weights; no graph is kept
    # for them (fusedkv.train.freeze). teacher_topk=K > 0: the teacher's top-K log-probabilities are stored
    # next to the prepared data once and read back by every later run (fusedkv.train.teacher_cache); the
    # batches then come from a fixed grid of seq_len windows. 0: the live teacher on random windows.
    freeze_lower_layers: bool = False
    teacher_topk: int = 0

    # ---- data ----------------------------------------------------------------------------------
    data: str | None = None  # source spec (builtin, file, dir, .jsonl, .parquet, hf:...) or prepared dir
    vocab_size: int | None = None  # tokenizer vocabulary == model vocabulary
    tokenizer: str | None = None  # an existing tokenizer (dir or hub name) instead of training a BPE
    data_dir: str | None = None  # prepared shards; None: $FUSEDKV_DATA_DIR or runs/data, /<source>-v<vocab>
    seq_len: int | None = None

    # ---- batch and budget ----------------------------------------------------------------------
    global_batch_tokens: int | None = None  # tokens per optimiser step, over all ranks
    micro_batch_size: int | None = None  # sequences per forward per rank (accumulation is derived)
    max_steps: int | None = None  # optimiser steps; or give max_tokens
    max_tokens: int | None = None  # token budget, rounded up to whole steps

    # ---- optimiser -----------------------------------------------------------------------------
    lr: float | None = None  # peak learning rate
    min_lr_ratio: float | None = None  # cosine floor as a fraction of the peak (paper: 0.1)
    warmup_steps: int | None = None
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    # Applied to 2-D weight matrices only (projections, embeddings, LM head); never to norms, biases
    # or fusion weights: see optim.param_groups for why.
    weight_decay: float = 0.1
    grad_clip: float = 1.0

    # ---- runtime -------------------------------------------------------------------------------
    seed: int = 0
    device: str = "auto"  # auto: cuda if available, else cpu
    dtype: str = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU (bf16 is ~24x slower on AVX2 CPUs)
    compile: bool = False  # torch.compile each decoder layer
    grad_checkpointing: bool | None = None  # recompute decoder layers in backward; None: the preset's (or off)
    distributed: str | None = None  # none | ddp | fsdp (launch with torchrun for ddp/fsdp)
    # torch CPU threads; None: torch's default (one per core). On a CPU shared with other jobs, 1
    # avoids OpenMP threads spinning against each other.
    threads: int | None = None

    # ---- evaluation, logging, checkpoints -------------------------------------------------------
    eval_every: int | None = None  # steps between validation losses (0: only at the end)
    eval_batches: int | None = None  # micro-batches per periodic validation
    final_eval_batches: int | None = None  # micro-batches for the final validation (capped by the split)
    ckpt_every: int | None = None  # steps between training checkpoints (0: only at the end)
    keep_checkpoints: int = 2  # complete checkpoints kept (the newest ones)
    # full: state gathered to rank 0, which writes it (full_checkpoint.py); sharded: every rank writes its own shard
    # with torch.distributed.checkpoint, asynchronously, and resumes on any number of ranks (sharded_checkpoint.py)
    checkpoint_format: str | None = None  # None: the preset's (sharded for the paper presets), else full
    out_dir: str | None = None  # None: runs/<preset>-<plan>
    resume: bool | str = False  # True: newest intact checkpoint in out_dir; a path: that run or checkpoint
    overwrite: bool = False  # start afresh in an out_dir that already holds a run (replaces it)
    progress: bool = True  # progress bar and summary on stdout; False: quiet (library use)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            setattr(self, f.name, coerce(f.name, _FIELD_TYPES[f.name], getattr(self, f.name)))
        if self.preset not in PRESETS:
            raise ValueError(f"preset={self.preset!r}: unknown preset; choose one of {', '.join(PRESET_NAMES)}")
        preset = PRESETS[self.preset]
        if self.max_steps is None and self.max_tokens is None:
            self.max_steps, self.max_tokens = preset.get("max_steps"), preset.get("max_tokens")
        # With init_from the architecture (dims, vocabulary, RoPE base) comes from the checkpoint; the
        # preset then only supplies the training recipe.
        skip = {"model", "max_steps", "max_tokens"} | ({"vocab_size", "rope_theta"} if self.init_from else set())
        micro_from_preset = self.micro_batch_size is None
        for key, value in preset.items():
            if key not in skip and getattr(self, key) is None:
                setattr(self, key, coerce(key, _FIELD_TYPES[key], value))
        if micro_from_preset and self.seq_len > 0 and self.global_batch_tokens % self.seq_len == 0:
            # The preset's micro-batch is an upper bound: a longer seq_len at the same global batch
            # in tokens leaves fewer sequences per step, so take the largest micro-batch that divides
            # them (an explicitly set micro_batch_size is kept, and checked by validate()).
            seqs = self.global_batch_tokens // self.seq_len
            fits = range(1, min(self.micro_batch_size, seqs) + 1)
            self.micro_batch_size = max(d for d in fits if seqs % d == 0)
        self.model = _check_model_overrides(self.model if self.init_from else {**preset["model"], **self.model})
        if self.kv_sharing is None and self.init_from is None:
            self.kv_sharing = DEFAULT_PLAN
        if self.distributed is None:
            self.distributed = "none"
        if self.checkpoint_format is None:
            self.checkpoint_format = "full"
        if self.grad_checkpointing is None:
            self.grad_checkpointing = False
        if self.out_dir is None:
            self.out_dir = str(Path("runs") / f"{self.preset}-{self.kv_sharing or 'init'}")
        self.validate()

    # ---- validation ----------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the field and the fix. Every number is range-checked."""

        def need(cond, name, msg):
            if not cond:
                raise ValueError(f"{name}={getattr(self, name)!r}: {msg}")

        if self.kv_sharing is not None:
            try:
                _ = self.plan_choice
            except ValueError as e:
                need(False, "kv_sharing", str(e))
        need(  # a checkpoint to start from carries its own source map
            self.kv_sharing != CUSTOM or "kv_source_map" in self.model or self.init_from is not None,
            "kv_sharing",
            "a custom plan needs model.kv_source_map (see FusedKVConfig)",
        )
        need(self.vocab_size is not None or self.init_from is not None, "vocab_size", "must be set")
        for name in ("vocab_size", "seq_len", "global_batch_tokens", "micro_batch_size", "max_steps", "max_tokens"):
            need(getattr(self, name) is None or getattr(self, name) > 0, name, "must be a positive integer")
        need(self.max_steps is not None or self.max_tokens is not None, "max_steps", "give max_steps or max_tokens")
        need(
            self.global_batch_tokens % self.seq_len == 0,
            "global_batch_tokens",
            f"must be a multiple of seq_len={self.seq_len} (whole sequences per step), e.g. "
            f"{max(1, round(self.global_batch_tokens / self.seq_len)) * self.seq_len} (binary suffixes are: 1Mi = "
            "2^20 tokens)",
        )
        need(
            self.global_batch_sequences % self.micro_batch_size == 0,
            "micro_batch_size",
            f"must divide the {self.global_batch_sequences} sequences of the global batch "
            f"(global_batch_tokens / seq_len)",
        )
        for name in ("lr", "eps", "rope_theta"):
            value = getattr(self, name)
            need(value is None or (math.isfinite(value) and value > 0), name, "must be a positive number")
        need(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1] (paper: 0.1)")
        need(all(0 <= b < 1 for b in self.betas), "betas", "both must be in [0, 1) (paper: 0.9, 0.95)")
        need(math.isfinite(self.weight_decay) and self.weight_decay >= 0, "weight_decay", "must be >= 0 (paper: 0.1)")
        need(
            math.isfinite(self.grad_clip) and self.grad_clip >= 0,
            "grad_clip",
            "must be >= 0 (0 disables clipping; paper: 1.0)",
        )
        for name in ("warmup_steps", "seed", "eval_every", "eval_batches", "ckpt_every"):
            need(getattr(self, name) >= 0, name, "must be >= 0")
        need(self.final_eval_batches > 0, "final_eval_batches", "must be positive")
        need(self.threads is None or self.threads >= 1, "threads", "must be >= 1 (or None for torch's default)")
        need(self.keep_checkpoints >= 1, "keep_checkpoints", "must be >= 1 (the last good one is always kept)")
        need(self.device in DEVICES, "device", f"choose one of {DEVICES}")
        need(self.dtype in DTYPES, "dtype", f"choose one of {DTYPES}")
        need(self.distributed in DISTRIBUTED_MODES, "distributed", f"choose one of {DISTRIBUTED_MODES}")
        need(self.checkpoint_format in ("full", "sharded"), "checkpoint_format", "choose full or sharded")
        need(not (self.resume and self.overwrite), "overwrite", "cannot be combined with resume")
        need(0 <= self.distill_alpha <= 1, "distill_alpha", "must be in [0, 1] (1: distillation only, 0: LM only)")
        need(math.isfinite(self.distill_temperature) and self.distill_temperature > 0, "distill_temperature",
             "must be a positive number")
        need(math.isfinite(self.distill_hidden_weight) and self.distill_hidden_weight >= 0, "distill_hidden_weight",
             "must be >= 0 (0: logits only)")
        need(self.teacher_topk >= 0, "teacher_topk", "must be >= 0 (0: the live teacher; e.g. 64)")
        need(not (self.teacher_topk and self.distill_hidden_weight > 0), "teacher_topk",
             "stores logits only: it cannot serve distill_hidden_weight > 0; set one of them to 0")
        need(not self.teacher_topk or self.distill_from is not None, "teacher_topk",
             "stores a teacher's logits: it needs distill_from")
        if self.init_from is None:
            self.model_config()  # the model's own checks (head counts, plan, source map ...), up front

    def model_config(self) -> FusedKVConfig:
        """The FusedKVConfig of a fresh run (not `init_from`: that one comes from the checkpoint)."""
        try:
            return FusedKVConfig(
                vocab_size=self.vocab_size, kv_sharing=self.kv_sharing, rope_theta=self.rope_theta, **self.model
            )
        except (TypeError, ValueError) as e:  # the model config names its field
            raise ValueError(f"model: {e}") from e

    # ---- derived values ------------------------------------------------------------------------
    @property
    def plan_choice(self) -> PlanChoice | None:
        """The plan as `fusedkv.plan.resolve_plan_choice` reads `kv_sharing` (None: the checkpoint's plan)."""
        return None if self.kv_sharing is None else resolve_plan_choice(self.kv_sharing)

    @property
    def global_batch_sequences(self) -> int:
        return self.global_batch_tokens // self.seq_len

    def grad_accum_steps(self, world_size: int = 1) -> int:
        """Micro-batches per optimiser step on each rank, so that the global batch is exact."""
        per_rank, rem = divmod(self.global_batch_sequences, world_size)
        if rem or per_rank % self.micro_batch_size:
            raise ValueError(
                f"global_batch_tokens={self.global_batch_tokens} is {self.global_batch_sequences} sequences, "
                f"which does not split into {world_size} ranks x micro_batch_size={self.micro_batch_size}; "
                "change micro_batch_size or global_batch_tokens"
            )
        return per_rank // self.micro_batch_size

    def total_steps(self) -> int:
        if self.max_steps is not None:
            return self.max_steps
        return -(-self.max_tokens // self.global_batch_tokens)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        """From a dict such as `to_dict()` gives, a YAML file or a checkpoint's saved config (old names
        and bare model fields are accepted, see `normalise`)."""
        return cls(**normalise(d))

    def replace(self, **changes) -> TrainConfig:
        _check_keys(changes)
        return dataclasses.replace(self, **changes)


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(TrainConfig))
_FIELD_TYPES = typing.get_type_hints(TrainConfig)


# ---- layers: YAML, key=value overrides, saved configs ----------------------------------------------------
def resolve_config(
    config_file: str | Path | None = None, overrides=(), base: dict | None = None, **kwargs
) -> TrainConfig:
    """Build a TrainConfig from layers: preset < `base` (e.g. a checkpoint's saved config) < YAML file <
    `overrides` ("key=value" strings) < kwargs.

    kwargs that are None are ignored (unset CLI flags). `model` dicts merge key by key. Setting one of
    max_steps / max_tokens in a layer clears the other from the layers below it.
    """
    layers = [dict(base)] if base else []
    if config_file is not None:
        layers.append(load_yaml(config_file))
    layers.append(parse_overrides(overrides))
    layers.append({k: v for k, v in kwargs.items() if v is not None})
    merged: dict = {}
    for layer in layers:
        layer = normalise(layer)
        if "max_steps" in layer and "max_tokens" not in layer:
            merged.pop("max_tokens", None)
        if "max_tokens" in layer and "max_steps" not in layer:
            merged.pop("max_steps", None)
        model = {**merged.get("model", {}), **layer.get("model", {})}
        merged.update(layer)
        if model:
            merged["model"] = model
    return TrainConfig(**merged)


def load_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    try:
        d = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"config file {p} is not valid YAML: {e}") from e
    if not isinstance(d, dict):
        raise ValueError(f"config file {p} must hold a mapping of TrainConfig fields, got {type(d).__name__}")
    return d


def parse_overrides(items) -> dict:
    """["lr=1e-3", "model.num_hidden_layers=6", "betas=[0.9,0.99]"] -> nested dict. Values are parsed
    as YAML scalars/lists (so 1e-3, true, null and [a, b] work); types are checked by the config.
    The one `--set` parser (`fusedkv compare --set` uses it too)."""
    out: dict = {}
    for item in items or ():
        key, sep, raw = str(item).partition("=")
        key = key.strip()
        if not sep or not key or key.startswith(".") or key.endswith("."):
            raise ValueError(f"--set {item!r}: expected key=value (e.g. lr=1e-3 or model.hidden_size=256)")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {item!r}: {part!r} is not a mapping")
        node[leaf] = value
    return out


def normalise(d: dict) -> dict:
    """One layer of settings in TrainConfig's names: aliases (`plan`, `rope_base`) renamed, bare
    FusedKVConfig field names (hidden_size=...) and model.kv_sharing / model.rope_theta / model.vocab_size
    moved to where they live. Unknown keys are refused with the closest field name."""
    d = dict(d)
    model = dict(d.pop("model", None) or {})
    for key in _TOP_LEVEL_MODEL_FIELDS:
        if key in model:
            d.setdefault(key, model.pop(key))
    for old, new in ALIASES.items():
        if old in d:
            value = d.pop(old)
            if d.get(new) is None:
                d[new] = value
    for key in list(d):
        if key not in _FIELD_NAMES and key in MODEL_FIELDS:
            model[key] = d.pop(key)
    _check_keys(d)
    if model:
        d["model"] = model
    return d


def _check_keys(d: dict) -> None:
    for key in d:
        if key not in _FIELD_NAMES:
            close = difflib.get_close_matches(key, _FIELD_NAMES + MODEL_FIELDS + tuple(ALIASES), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown TrainConfig field {key!r}{hint} (fields: {', '.join(_FIELD_NAMES)})")


# ---- model overrides: FusedKVConfig's own field types (fusedkv.config.field_types) ------------------------
def _check_model_overrides(model: dict) -> dict:
    """Known FusedKVConfig fields with values of their types; `model.hidden_size=abc` is refused here,
    naming the key, before any model is built."""
    out = {}
    for key, value in model.items():
        if key not in MODEL_FIELDS:
            close = difflib.get_close_matches(key, MODEL_FIELDS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"model.{key}: not a FusedKVConfig field{hint}")
        hint = field_types().get(key)
        out[key] = value if hint is None else coerce(f"model.{key}", hint, value)
        if isinstance(out[key], float) and not math.isfinite(out[key]):
            raise ValueError(f"model.{key}={value!r}: must be a finite number")
    return out
