"""What one imported model family is to `fusedkv convert`: its Hugging Face model types and the function
from its transformers config (a dict, as config.json holds it) to a `FusedKVConfig`.

Each family lives in its own module of this package (`qwen3.py`, `llama.py`, ...) as a module-level
`FAMILY`, and is listed once in `families.py`. A family reads every config field that changes the function
the checkpoint computes and refuses, with `UnsupportedField`, any value fusedkv cannot reproduce exactly:
nothing is imported approximately. The dense families do this with one table each (`FieldTable`): every
field of the family's transformers config, read through transformers' own config class (so legacy names
such as `rope_scaling` or `max_window_layers` are normalised exactly as transformers does), is either
carried over, checked, or recorded as not changing the function; a field the table does not know is refused.

Fields every transformers config may carry, whatever the family, are classified once here: `METADATA`
(bookkeeping that cannot change the logits: accepted) and `COMMON` (switches that would change the
computation: only their inert value is accepted). A field is in exactly one of METADATA, COMMON and a
family's own table (tests/convert/test_fields.py checks it, and tests/convert/test_real_configs.py runs the
published config.json of a real model of every family through it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config import FusedKVConfig
from ..config_fields import ACTIVATIONS, rope_parameters_by_type


class UnsupportedField(ValueError):
    """A checkpoint uses a config field (or value) that fusedkv cannot reproduce exactly."""

    def __init__(self, field: str, value, why: str = "", fix: str = ""):
        self.field = field
        super().__init__(f"config field {field}={value!r} is not supported" + (f": {why}" if why else "")
                         + (f"; {fix}" if fix else ""))


def _same_state(state: dict[str, torch.Tensor], config: FusedKVConfig, partial: bool = False
                ) -> dict[str, torch.Tensor]:
    return state


@dataclass(frozen=True)
class Family:
    name: str  # as users know it, for messages: "Qwen3", "Llama", ...
    model_types: tuple[str, ...]  # transformers' `model_type` values this family imports
    # transformers config dict -> FusedKVConfig keyword arguments (without kv_sharing); raises UnsupportedField
    config_fields: Callable[[dict], dict]
    # the checkpoint's tensors (transformers' names) -> fusedkv's names and layouts, for a model of `config`;
    # called once per shard with partial=True (tensors that need others not read yet, e.g. one layer's
    # experts split across shards, are returned as they are) and once more at the end with partial=False
    prepare_state: Callable[..., dict[str, torch.Tensor]] = _same_state
    # the transformers class that computes this family (tests compare against it), for --help and messages
    transformers_class: str = ""

    def to_config(self, hf: dict, kv_sharing: str, **overrides) -> FusedKVConfig:
        if hf.get("model_type") not in self.model_types:
            types = " or ".join(map(repr, self.model_types))
            got = hf.get("model_type")
            raise ValueError(f"expected a {self.name} checkpoint (model_type {types}), got model_type {got!r}")
        return FusedKVConfig(**with_plan_kv_heads({**self.config_fields(hf), **overrides}, kv_sharing, overrides),
                             kv_sharing=kv_sharing)


def with_plan_kv_heads(fields: dict, kv_sharing: str, overrides: dict) -> dict:
    """`fields` with the KV-head count a `PLAN+gqa` choice asks for (half the query heads) where that is fewer
    than the checkpoint has: the import then mean-pools each group of K/V heads (`core.pool_kv_heads`). A
    checkpoint that already has at most that many keeps its own."""
    from ..plan import CUSTOM, PLAN_NAMES, resolve_plan_choice

    if kv_sharing in (*PLAN_NAMES, CUSTOM) or "num_key_value_heads" in overrides:
        return fields
    heads = fields["num_attention_heads"]
    want = resolve_plan_choice(kv_sharing).num_key_value_heads(heads, fields.get("num_key_value_heads"))
    return {**fields, "num_key_value_heads": min(want, fields.get("num_key_value_heads") or heads)}


# ---- the field tables ------------------------------------------------------------------------------------

# Fields every transformers config carries that say nothing about the function computed (bookkeeping, names,
# output switches, special-token ids a causal LM's forward never reads, task heads fusedkv does not build,
# framework switches of older transformers, generation defaults of older configs).
METADATA = frozenset({
    "_name_or_path", "_model_name_or_path", "model_name", "architectures", "chunk_size_feed_forward", "dtype",
    "torch_dtype", "id2label", "label2id", "model_type", "output_attentions", "output_hidden_states",
    "problem_type", "return_dict", "transformers_version", "use_cache", "cache_implementation",
    "is_encoder_decoder", "tokenizer_class", "prefix", "task_specific_params", "finetuning_task", "auto_map",
    "max_length", "min_length", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "num_beams",
    "use_return_dict", "unk_token_id", "sep_token_id", "cls_token_id", "mask_token_id", "decoder_start_token_id",
    "torchscript", "use_bfloat16", "tf_legacy_loss", "cross_attention_hidden_size", "tie_encoder_decoder",
    "_attn_implementation_autoset", "_attn_implementation", "attn_implementation", "bad_words_ids",
    "begin_suppress_tokens", "diversity_penalty", "early_stopping", "encoder_no_repeat_ngram_size",
    "exponential_decay_length_penalty", "forced_bos_token_id", "forced_eos_token_id", "length_penalty",
    "no_repeat_ngram_size", "num_beam_groups", "num_return_sequences", "output_scores", "remove_invalid_values",
    "return_dict_in_generate", "suppress_tokens", "typical_p", "transformers.js_config",
})


@dataclass(frozen=True)
class Copy:
    """Carried over as the FusedKVConfig field `to` (default: the same name)."""
    to: str | None = None


@dataclass(frozen=True)
class Ignore:
    """Read and known not to change the function computed (why says so)."""
    why: str


@dataclass(frozen=True)
class Require:
    """Only values for which `ok(value)` holds are reproduced; others are refused (`fix`: what the user can do)."""
    ok: Callable[[object], bool]
    why: str
    fix: str = ""

    def check(self, name: str, value) -> None:
        if not self.ok(value):
            raise UnsupportedField(name, value, self.why, self.fix)


@dataclass(frozen=True)
class Read:
    """A function of (value, the whole normalised config) -> FusedKVConfig fields; raises UnsupportedField."""
    fn: Callable[[object, dict], dict]


@dataclass(frozen=True)
class FieldTable:
    """One family's supported fields. `fixed`: FusedKVConfig fields the family's architecture implies
    (what transformers' modeling file hard-codes), or a function of the normalised config giving them."""
    family: str
    config_class: str  # transformers' config class, by name: it normalises the dict first
    fields: dict = field(default_factory=dict)
    fixed: Callable[[dict], dict] = lambda cfg: {}

    def read(self, hf: dict) -> dict:
        cfg = normalised(hf, self.config_class)
        out: dict = {}
        for name, value in cfg.items():
            rule = self.fields.get(name) or COMMON.get(name)
            if rule is None:
                if name in METADATA:
                    continue
                raise unknown_field(name, value, self.family)
            if isinstance(rule, Copy):
                out[rule.to or name] = value
            elif isinstance(rule, Require):
                rule.check(name, value)
            elif isinstance(rule, Read):
                out.update(rule.fn(value, cfg))
        out.update(self.fixed(cfg))
        return out

    def known(self) -> frozenset[str]:
        return frozenset(self.fields) | METADATA | frozenset(COMMON)


def unknown_field(name: str, value, family: str) -> UnsupportedField:
    return UnsupportedField(name, value, f"fusedkv's {family} import does not know this field, so it cannot tell "
                            "whether the model computes the same function",
                            "if it does not change the computation, delete it from config.json")


def normalised(hf: dict, config_class: str) -> dict:
    """`hf` as transformers' own config class reads it (legacy field names and defaults resolved)."""
    import transformers

    cls = getattr(transformers, config_class)
    fields = {k: v for k, v in hf.items() if k not in ("model_type", "transformers_version")}
    try:
        return cls(**fields).to_dict()
    except (TypeError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"config.json is not a valid {config_class}: {first}") from e


# ---- rules shared by the families ------------------------------------------------------------------------

def read_activation(value, cfg) -> dict:
    if value not in ACTIVATIONS:
        raise UnsupportedField("hidden_act", value, f"fusedkv computes {', '.join(ACTIVATIONS)}")
    return {"hidden_act": value}


def read_rope(value, cfg) -> dict:
    """transformers' normalised `rope_parameters` (one dict, or one per attention type) -> fusedkv's, the same
    layout; refuses a RoPE type or option fusedkv does not compute."""
    from types import SimpleNamespace

    try:
        by_type = rope_parameters_by_type(SimpleNamespace(rope_parameters=value))
    except ValueError as e:
        raise UnsupportedField("rope_parameters", value, str(e)) from e
    used = set(cfg.get("layer_types") or ["full_attention"])
    kept = {t: dict(p) for t, p in by_type.items() if t is None or t in used or len(by_type) == 1}
    if None in kept:
        return {"rope_parameters": kept[None]}
    return {"rope_parameters": kept if len(kept) > 1 else {**next(iter(kept.values()))}}


def read_window(value, cfg) -> dict:
    """`sliding_window` and `layer_types`: a window at least max_position_embeddings long never masks a key
    of an input fusedkv accepts, so those layers are full attention (exactly)."""
    types = list(cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"])
    if "sliding_attention" not in types or value is None:
        return {"layer_types": ["full_attention"] * len(types), "sliding_window": None}
    if value >= cfg["max_position_embeddings"]:
        return {"layer_types": ["full_attention"] * len(types), "sliding_window": None}
    return {"layer_types": types, "sliding_window": value}


SHAPE = {name: Copy() for name in (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
    "bos_token_id", "eos_token_id", "pad_token_id")}
SHAPE.update({
    "initializer_range": Copy(),  # how fresh weights (fusion) are drawn; not the imported function
    "attention_dropout": Copy(),  # training only: inference never drops
    "hidden_act": Read(read_activation),
    "rope_parameters": Read(read_rope),
})
WINDOWS = {
    "sliding_window": Read(read_window),
    "layer_types": Ignore("read with sliding_window"),
}


def no(value) -> bool:
    return not value


def _float_weights(value) -> bool:
    """No quantization, or the record a transformers GGUF load leaves: its weights were dequantised to floats."""
    return not value or (isinstance(value, dict) and value.get("quant_method") == "gguf")


# Switches any transformers config may carry that would change the computation: only the inert value is
# accepted, in every family.
COMMON = {
    "use_mrope": Require(no, "multimodal RoPE (sections per position axis) is not computed by fusedkv",
                         "import the text model of a checkpoint without it"),
    "is_decoder": Require(no, "is_decoder belongs to encoder(-decoder) models, fusedkv imports decoder-only LMs",
                          "set is_decoder to false if the checkpoint is a causal LM"),
    "add_cross_attention": Require(no, "cross-attention layers are not built by fusedkv",
                                   "import a decoder-only checkpoint"),
    "pruned_heads": Require(no, "pruned attention heads change the projections' shapes per layer",
                            "import the unpruned model"),
    "quantization_config": Require(_float_weights, "the checkpoint stores quantised weights, fusedkv imports float "
                                   "ones", "dequantise the weights (e.g. DeepSeek-V3's fp8: its "
                                   "inference/fp8_cast_bf16.py), then delete quantization_config"),
}
