"""`TrainConfig`: one dataclass that says everything a training run needs, and the presets.

A run is fully described by a `TrainConfig`: the model (a preset's dimensions plus overrides of any
`FusedKVConfig` field, and the KV-sharing plan), the data (source spec, tokenizer vocabulary,
prepared-data directory), the batch and token budget, the optimiser (the paper's AdamW recipe), the
runtime (device, dtype, compile, activation checkpointing, DDP/FSDP2) and the bookkeeping (evaluation,
checkpoints, output directory, resume). The resolved config is saved with every checkpoint, so a run
can always be reproduced or resumed from what is on disk.

Values come in layers, later layers winning: the preset, a YAML file, `--set key=value` overrides
and explicit keyword arguments / CLI flags. Fields left at `None` are filled from the preset by
`__post_init__`, so `TrainConfig(preset="nano", plan="vanilla")` is complete on its own (this is what
the experiment runner constructs). Every bad key or value raises `ValueError` naming the field.

Presets
-------
* Paper sizes (SPEC section 4, App. A.2 / Table 4): `332m`, `650m`, `1.5b`, `4b` - vocabulary
  128,000, context 8192, RoPE base 10,000, untied embeddings, batch 512 sequences, AdamW (0.9, 0.95),
  weight decay 0.1, clip 1.0, 2000 warm-up steps, cosine 3e-4 -> 3e-5, and the paper's token budgets.
  The paper does not give the MLP width; we use Qwen3's choice: 3 x hidden (Qwen3-0.6B/1.7B use
  exactly 3x), and 9728 for 4B (Qwen3-4B's width, 3.8x). Counting one embedding matrix but not the
  LM head, that gives 295M / 687M / 1.57B / 3.96B parameters for vanilla (the last two match the
  paper's names; the paper's "332M" is exactly what a 4x MLP would give, so its MLP may be wider -
  set `model.intermediate_size=4096` to follow that reading).
* `tiny`: the default CPU run (`fusedkv train`): 4 layers, hidden 192, 4 heads of 48, vocab 4096,
  context 256, 600 steps of 2048 tokens (1.2M tokens) on the built-in corpus; ~5 minutes on 2 CPU
  cores, data preparation included.
* `nano`: for tests: 4 layers, hidden 64, vocab 512, context 64, 8 steps, gradient accumulation 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..config import FusedKVConfig
from ..plan import CUSTOM, DEFAULT_PLAN, PLAN_CHOICES, resolve_plan_choice

PLANS = (*PLAN_CHOICES, CUSTOM)  # what --plan lists; "PLAN+gqa" is accepted too (fusedkv.plan)
DISTRIBUTED_MODES = ("none", "ddp", "fsdp")
DTYPES = ("auto", "float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")

# The paper's optimisation recipe (SPEC section 4), shared by the four paper presets.
_PAPER_RECIPE = dict(
    vocab_size=128_000,
    seq_len=8192,
    rope_base=10_000.0,
    global_batch_tokens=512 * 8192,  # 512 sequences of 8192 tokens
    micro_batch_size=1,
    lr=3e-4,
    min_lr_ratio=0.1,
    warmup_steps=2000,
    # FineWeb-Edu like the paper; a streamed sample, since the full budget needs a pre-tokenised corpus.
    data="hf:HuggingFaceFW/fineweb-edu:sample-10BT:train",
    eval_every=1000,
    eval_batches=50,
    final_eval_batches=500,
    ckpt_every=1000,
    distributed="fsdp",
)


def _paper(layers: int, hidden: int, heads: int, intermediate: int, tokens: float, **extra) -> dict:
    model = dict(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        max_position_embeddings=8192,
    )
    return {**_PAPER_RECIPE, "model": model, "max_tokens": int(tokens), **extra}


PRESETS: dict[str, dict] = {
    "332m": _paper(12, 1024, 16, 3 * 1024, 200e9),
    "650m": _paper(16, 1536, 16, 3 * 1536, 200e9),
    "1.5b": _paper(24, 2048, 16, 3 * 2048, 400e9, grad_checkpointing=True),
    "4b": _paper(36, 2560, 32, 9728, 800e9, grad_checkpointing=True),
    # Sized so `fusedkv train` (data preparation included) finishes in a few minutes on 2 CPU cores.
    # A higher peak LR and a short warm-up than the paper: small models train stably at 2e-3 and the
    # run is only a few hundred steps long.
    "tiny": dict(
        model=dict(
            num_hidden_layers=4,
            hidden_size=192,
            num_attention_heads=4,  # even, so that the gqa plan really halves the KV heads
            intermediate_size=576,
            max_position_embeddings=256,
        ),
        vocab_size=4096,
        seq_len=256,
        rope_base=10_000.0,
        data="builtin",
        global_batch_tokens=8 * 256,
        micro_batch_size=8,
        max_steps=600,
        lr=2e-3,
        min_lr_ratio=0.1,
        warmup_steps=30,
        eval_every=150,
        eval_batches=8,
        final_eval_batches=40,
        ckpt_every=150,
    ),
    # For tests: seconds per run; accumulation 2 so the accumulation path is always exercised.
    "nano": dict(
        model=dict(
            num_hidden_layers=4,
            hidden_size=64,
            num_attention_heads=4,
            intermediate_size=192,
            max_position_embeddings=64,
        ),
        vocab_size=512,
        seq_len=64,
        rope_base=10_000.0,
        data="builtin",
        global_batch_tokens=8 * 64,
        micro_batch_size=4,
        max_steps=8,
        lr=3e-3,
        min_lr_ratio=0.1,
        warmup_steps=2,
        eval_every=4,
        eval_batches=2,
        final_eval_batches=4,
        ckpt_every=4,
    ),
}
PRESET_NAMES = tuple(PRESETS)

# Fields of FusedKVConfig that TrainConfig owns at the top level (so there is one place to set them).
_MODEL_FIELDS_OWNED = {
    "vocab_size": "vocab_size",
    "kv_sharing": "plan",
    "rope_parameters": "rope_base",
    "rope_theta": "rope_base",
}
MODEL_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(FusedKVConfig)
    if f.name not in _MODEL_FIELDS_OWNED and f.name in FusedKVConfig.__annotations__
)


@dataclass
class TrainConfig:
    """Everything a training run needs. `None` means "take it from the preset"."""

    # ---- model ---------------------------------------------------------------------------------
    preset: str = "tiny"  # one of PRESET_NAMES: model dims + the training recipe that goes with them
    plan: str | None = None  # kv_sharing plan; None: "fusedkv" (or the --init-from checkpoint's plan)
    model: dict = field(default_factory=dict)  # FusedKVConfig overrides on top of the preset's dims
    rope_base: float | None = None  # RoPE theta (paper: 10,000; 50,000 / 500,000 for long context)
    init_from: str | None = None  # start from a saved model directory's weights (save_pretrained)

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
    grad_checkpointing: bool = False  # recompute decoder layers in backward (activation checkpointing)
    distributed: str | None = None  # none | ddp | fsdp (launch with torchrun for ddp/fsdp)
    # torch CPU threads; None: torch's default (one per core). On a CPU shared with other jobs, 1
    # avoids OpenMP threads spinning against each other (measured up to 5x slower with 2 of 2 cores).
    threads: int | None = None

    # ---- evaluation, logging, checkpoints -------------------------------------------------------
    eval_every: int | None = None  # steps between validation losses (0: only at the end)
    eval_batches: int | None = None  # micro-batches per periodic validation
    final_eval_batches: int | None = None  # micro-batches for the final validation (capped by the split)
    ckpt_every: int | None = None  # steps between training checkpoints (0: only at the end)
    keep_checkpoints: int = 2  # complete checkpoints kept (the newest ones)
    out_dir: str | None = None  # None: runs/<preset>-<plan>
    resume: bool | str = False  # True: latest checkpoint in out_dir; a path: that checkpoint
    overwrite: bool = False  # start afresh in an out_dir that already holds a run (deletes it)
    progress: bool = True  # progress bar and summary on stdout; False: quiet (library use)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            setattr(self, f.name, _coerce(f.name, getattr(self, f.name)))
        if self.preset not in PRESETS:
            raise ValueError(
                f"preset={self.preset!r}: unknown preset; choose one of {', '.join(PRESET_NAMES)}"
            )
        preset = PRESETS[self.preset]
        if self.max_steps is None and self.max_tokens is None:
            self.max_steps, self.max_tokens = preset.get("max_steps"), preset.get("max_tokens")
        # With init_from the architecture (dims, vocabulary, RoPE base) comes from the checkpoint; the
        # preset then only supplies the training recipe.
        skip = {"model", "max_steps", "max_tokens"} | (
            {"vocab_size", "rope_base"} if self.init_from else set()
        )
        micro_from_preset = self.micro_batch_size is None
        for key, value in preset.items():
            if key not in skip and getattr(self, key) is None:
                setattr(self, key, _coerce(key, value))
        if micro_from_preset and self.seq_len > 0 and self.global_batch_tokens % self.seq_len == 0:
            # The preset's micro-batch is an upper bound: a longer seq_len at the same global batch
            # in tokens leaves fewer sequences per step, so take the largest micro-batch that divides
            # them (an explicitly set micro_batch_size is kept, and checked by validate()).
            seqs = self.global_batch_tokens // self.seq_len
            fits = range(1, min(self.micro_batch_size, seqs) + 1)
            self.micro_batch_size = max(d for d in fits if seqs % d == 0)
        self.model = _check_model_overrides(
            self.model if self.init_from else {**preset["model"], **self.model}
        )
        if self.plan is None and self.init_from is None:
            self.plan = DEFAULT_PLAN
        if self.distributed is None:
            self.distributed = "none"
        if self.out_dir is None:
            self.out_dir = str(Path("runs") / f"{self.preset}-{self.plan or 'init'}")
        self.validate()

    # ---- validation ----------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the field and the fix."""

        def need(cond, name, msg):
            if not cond:
                raise ValueError(f"{name}={getattr(self, name)!r}: {msg}")

        if self.plan is not None:
            try:
                resolve_plan_choice(self.plan)
            except ValueError as e:
                need(False, "plan", str(e))
        need(
            self.plan != CUSTOM or "kv_source_map" in self.model,
            "plan",
            "a custom plan needs model.kv_source_map (see FusedKVConfig)",
        )
        need(self.vocab_size is not None or self.init_from is not None, "vocab_size", "must be set")
        for name in ("vocab_size", "seq_len", "global_batch_tokens", "micro_batch_size"):
            need(getattr(self, name) is None or getattr(self, name) > 0, name, "must be a positive integer")
        need(
            self.max_steps is not None or self.max_tokens is not None,
            "max_steps",
            "give max_steps or max_tokens",
        )
        for name in ("max_steps", "max_tokens"):
            need(getattr(self, name) is None or getattr(self, name) > 0, name, "must be a positive integer")
        need(
            self.global_batch_tokens % self.seq_len == 0,
            "global_batch_tokens",
            f"must be a multiple of seq_len={self.seq_len} (whole sequences per step)",
        )
        need(
            self.global_batch_sequences % self.micro_batch_size == 0,
            "micro_batch_size",
            f"must divide the {self.global_batch_sequences} sequences of the global batch "
            f"(global_batch_tokens / seq_len)",
        )
        need(self.lr > 0, "lr", "must be positive")
        need(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1] (paper: 0.1)")
        need(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        need(all(0 <= b < 1 for b in self.betas), "betas", "both must be in [0, 1) (paper: 0.9, 0.95)")
        need(self.eps > 0, "eps", "must be positive")
        need(self.weight_decay >= 0, "weight_decay", "must be >= 0 (paper: 0.1)")
        need(self.grad_clip >= 0, "grad_clip", "must be >= 0 (0 disables clipping; paper: 1.0)")
        need(self.rope_base is None or self.rope_base > 0, "rope_base", "must be positive")
        need(self.device in DEVICES, "device", f"choose one of {DEVICES}")
        need(self.dtype in DTYPES, "dtype", f"choose one of {DTYPES}")
        need(self.distributed in DISTRIBUTED_MODES, "distributed", f"choose one of {DISTRIBUTED_MODES}")
        for name in ("eval_every", "eval_batches", "ckpt_every"):
            need(getattr(self, name) >= 0, name, "must be >= 0")
        need(self.final_eval_batches > 0, "final_eval_batches", "must be positive")
        need(
            self.threads is None or self.threads >= 1, "threads", "must be >= 1 (or None for torch's default)"
        )
        need(
            self.keep_checkpoints >= 1, "keep_checkpoints", "must be >= 1 (the last good one is always kept)"
        )
        need(not (self.resume and self.overwrite), "overwrite", "cannot be combined with resume")

    # ---- derived values ------------------------------------------------------------------------
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
        _check_keys(d)
        return cls(**d)

    def replace(self, **changes) -> TrainConfig:
        _check_keys(changes)
        return dataclasses.replace(self, **changes)


# ---- loading from YAML and key=value overrides ------------------------------------------------------
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
        layer = _normalise_keys(layer)
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
    as YAML scalars/lists (so 1e-3, true, null and [a, b] work); field types are checked later."""
    out: dict = {}
    for item in items or ():
        key, sep, raw = str(item).partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"override {item!r}: expected key=value (e.g. lr=1e-3 or model.hidden_size=256)")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        if key.startswith("model."):
            out.setdefault("model", {})[key[len("model.") :]] = value
        else:
            out[key] = value
    return out


def _normalise_keys(d: dict) -> dict:
    """Move bare FusedKVConfig field names (hidden_size=...) into `model`, and reject unknown keys."""
    d = dict(d)
    model = dict(d.pop("model", None) or {})
    for key in list(d):
        if key not in _FIELD_NAMES and key in MODEL_FIELDS:
            model[key] = d.pop(key)
        elif key == "rope_theta":
            d["rope_base"] = d.pop(key)
    _check_keys(d)
    if model:
        d["model"] = model
    return d


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(TrainConfig))


def _check_keys(d: dict) -> None:
    for key in d:
        if key not in _FIELD_NAMES:
            close = difflib.get_close_matches(key, _FIELD_NAMES + MODEL_FIELDS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown TrainConfig field {key!r}{hint} (fields: {', '.join(_FIELD_NAMES)})")


def _check_model_overrides(model: dict) -> dict:
    for key in model:
        if key in _MODEL_FIELDS_OWNED:
            raise ValueError(
                f"model.{key}: set it with the top-level field {_MODEL_FIELDS_OWNED[key]!r} instead"
            )
        if key not in MODEL_FIELDS:
            close = difflib.get_close_matches(key, MODEL_FIELDS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"model.{key}: not a FusedKVConfig field{hint}")
    return {key: _coerce_model_field(key, value) for key, value in model.items()}


def _model_field_types() -> dict:
    """FusedKVConfig's annotations as types (they are strings under `from __future__ import annotations`)."""
    out = {}
    for f in dataclasses.fields(FusedKVConfig):
        try:
            out[f.name] = eval(f.type, {"list": list, "dict": dict}) if isinstance(f.type, str) else f.type
        except Exception:  # e.g. Literal[...] of fields TrainConfig does not expose
            pass
    return out


_MODEL_TYPES = _model_field_types()


def _coerce_model_field(key: str, value):
    """`model.hidden_size=abc` is refused here, naming the key, before any model is built."""
    hint = _MODEL_TYPES.get(key)
    if hint is None:
        return value
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in args:
            return None
        raise ValueError(f"model.{key}: must not be None")
    errors = []
    for t in args:
        if t is type(None):
            continue
        if typing.get_origin(t) in (list, dict):
            if isinstance(value, typing.get_origin(t)):
                return value
            errors.append(f"not a {typing.get_origin(t).__name__}")
            continue
        try:
            return _coerce_one(t, value)
        except (TypeError, ValueError) as e:
            errors.append(str(e))
    raise ValueError(f"model.{key}={value!r}: expected {_type_name(hint)} ({'; '.join(errors)})")


# ---- type coercion ------------------------------------------------------------------------------------
_SUFFIX = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_TYPES = typing.get_type_hints(TrainConfig)


def _coerce(name: str, value):
    """Check/convert one field value to its annotated type; ValueError names the field."""
    hint = _TYPES[name]
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args):
        if type(None) in args:
            return None
        raise ValueError(f"{name}: must not be None")
    errors = []
    for t in args:
        if t is type(None):
            continue
        try:
            return _coerce_one(t, value)
        except (TypeError, ValueError) as e:
            errors.append(str(e))
    raise ValueError(f"{name}={value!r}: expected {_type_name(hint)} ({'; '.join(errors)})")


def _coerce_one(t, value):
    origin = typing.get_origin(t)
    if t is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        raise TypeError("not a boolean")
    if t is int:
        if isinstance(value, bool):
            raise TypeError("not an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            s = value.strip().lower().replace("_", "")
            mult = _SUFFIX.get(s[-1:], 1) if s else 1
            num = float(s[:-1] if mult != 1 else s)  # "2M" tokens, "1e6", "200b"
            if (num * mult).is_integer():
                return int(num * mult)
        raise TypeError("not an integer")
    if t is float:
        if isinstance(value, bool):
            raise TypeError("not a number")
        return float(value)
    if t is str:
        if isinstance(value, (str, Path)):
            return str(value)
        raise TypeError("not a string")
    if t is dict or origin is dict:
        if isinstance(value, dict):
            return dict(value)
        raise TypeError("not a mapping")
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.strip("()[] ").split(",") if v.strip()]
        items = list(value)
        elem = typing.get_args(t)
        if len(items) != len(elem):
            raise TypeError(f"need {len(elem)} values")
        return tuple(_coerce_one(e, v) for e, v in zip(elem, items))
    raise TypeError(f"unsupported type {t}")


def _type_name(hint) -> str:
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")
