"""`FusedKVConfig`: a Qwen3-style decoder configuration plus the KV-sharing plan.

Field names follow transformers' `Qwen3Config` so converted checkpoints and tools that read Qwen3
configs keep working. The plan is given by name (`kv_sharing`) or by a custom 1-based source map
(`kv_source_map`); `config.plan` turns either into a validated `KVSharingPlan`.

Every invalid combination raises `ValueError` naming the field and the fix, at construction time, so
bad configs never reach torch.
"""

from __future__ import annotations

import functools
import inspect
import operator
import types
import typing

from huggingface_hub.dataclasses import strict, type_validator
from transformers import PreTrainedConfig

from .plan import (
    ATTENTION_TYPES,
    CUSTOM,
    DEFAULT_PLAN,
    FULL,
    PLAN_NAMES,
    SLIDING,
    KVSharingPlan,
    build_plan,
    custom_plan,
    resolve_plan_choice,
)

FUSION_INITS = ("equivalent", "normal", "iterative")
MAX_LAYERS = 4096


def _admitting_ints(hint):
    """`hint` with every `float` widened to `float | int` (a float field takes the 0 or 1 a YAML file writes)."""
    if hint is float:
        return float | int
    args = typing.get_args(hint)
    if not args:
        return hint
    args = tuple(_admitting_ints(a) for a in args)
    if isinstance(hint, types.UnionType):
        return functools.reduce(operator.or_, args)
    return typing.get_origin(hint)[args]


@functools.cache
def field_types() -> dict:
    """FusedKVConfig's own fields and their annotations as types (they are strings in this module, which
    `@strict` skips), the one table both this config and `fusedkv.train.config` check values against."""
    return inspect.get_annotations(FusedKVConfig, eval_str=True)


def _check_field_types(config) -> None:
    """Every field holds the type its annotation names, checked by `@strict`'s own type validator (True is
    not an integer; a float field takes an int), so a wrong type from a config file or `--set` is a
    ValueError naming the field, not a TypeError from arithmetic on it later."""
    for name, hint in field_types().items():
        value = getattr(config, name)
        try:
            type_validator(name, value, _admitting_ints(hint))
        except TypeError:
            text = str(hint) if typing.get_args(hint) else hint.__name__
            raise ValueError(f"{name}={value!r}: expected {text.replace(' | ', ' or ')}") from None


@strict
class FusedKVConfig(PreTrainedConfig):
    r"""Configuration of a FusedKV decoder.

    Architecture fields are Qwen3's. FusedKV fields:
        kv_sharing: plan name (vanilla, cla, yoco, fusedkv-lite, fusedkv, fusedkv-dense) or "custom". The KV-head
            count is `num_key_value_heads`, independent of the plan (GQA = vanilla with fewer KV heads). The
            user shorthand "gqa" / "PLAN+gqa" (and checkpoints saved with kv_sharing="gqa") is resolved here
            by `fusedkv.plan.resolve_plan_choice` into the plan and half the KV heads.
        kv_source_map: for "custom": list of {"layers": [first, last], "k": [..], "v": [..],
            "k_fusion": "reuse"|"channel"|"scalar", "v_fusion": ...}, 1-based layer numbers.
        shared_attention_types: which attention types the upper half reconstructs (SWA hybrids: the
            paper's "+W" shares only sliding layers, "+WF" shares both). None = all.
        fusion_init: "equivalent" (default; the unrolled iterative recurrence), "normal" (weights drawn
            like other parameters) or "iterative" (the iterative architecture with its carried K/V).
        fusion_iterative_init: (carry, fixed) initial coefficients of the iterative recurrence
            K^i = carry * K^{i-1} + fixed * K^1, which "equivalent" unrolls.
        tie_rope_pairs: tie key fusion weights across each RoPE rotation pair (paper Sec. 2.4, App. A.4). Only
            switch off to demonstrate why it is needed.

    Mixture of experts (Qwen3-MoE's names and meaning; `fusedkv/model/moe.py`), off when num_experts=0:
        num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob, decoder_sparse_step,
        mlp_only_layers (0-based layers that keep the dense MLP), router_aux_loss_coef,
        output_router_logits (return router logits and the aux loss; training always computes it).

    Multi-head latent attention (DeepSeek-V2/V3's names; `fusedkv/model/mla.py`), on when kv_lora_rank
    is set: kv_lora_rank, q_lora_rank (None = full-rank query projection), qk_nope_head_dim,
    qk_rope_head_dim, v_head_dim. The cache holds the normalised latent and the decoupled RoPE key.
    """

    model_type = "fusedkv"
    keys_to_ignore_at_inference = ["cache"]

    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    attention_bias: bool = False
    attention_dropout: float | int = 0.0
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    kv_sharing: str = DEFAULT_PLAN
    kv_source_map: list[dict] | None = None
    shared_attention_types: list[str] | None = None
    fusion_init: str = "equivalent"
    fusion_iterative_init: list[float] | None = None
    tie_rope_pairs: bool = True
    num_experts: int = 0
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] | None = None
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128

    def __post_init__(self, **kwargs):
        _check_field_types(self)  # first: the defaults and checks below compute with these values
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads"):  # the defaults below use them
            v = getattr(self, name)
            if v <= 0:
                raise ValueError(f"{name}={v!r}: must be a positive integer")
        if self.num_hidden_layers > MAX_LAYERS:  # the plan holds one entry per layer: 10**9 would hang here
            raise ValueError(f"num_hidden_layers={self.num_hidden_layers}: at most {MAX_LAYERS} layers are supported")
        # transformers-4 style `rope_theta=` is accepted and stored the transformers-5 way.
        rope_theta = kwargs.pop("rope_theta", None)
        if rope_theta is not None and (isinstance(rope_theta, bool) or not isinstance(rope_theta, int | float)):
            raise ValueError(f"rope_theta={rope_theta!r}: must be a number")
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": float(rope_theta or 10000.0)}
        elif rope_theta is not None:
            self.rope_parameters = {**self.rope_parameters, "rope_theta": float(rope_theta)}
        if self.kv_lora_rank is not None and self.head_dim is None:
            self.head_dim = self.qk_rope_head_dim  # MLA: head_dim sizes the RoPE tables, as in DeepSeek-V3
        if self.head_dim is None and self.num_attention_heads and self.hidden_size % self.num_attention_heads == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.kv_sharing in PLAN_NAMES or self.kv_sharing == CUSTOM:
            choice = None
        else:  # a user shorthand such as "gqa" or "fusedkv+W" (older checkpoints saved "gqa"): plan + settings
            choice = resolve_plan_choice(self.kv_sharing)
            self.kv_sharing = choice.sharing
            if choice.shared_attention_types is not None and self.shared_attention_types is None:
                self.shared_attention_types = list(choice.shared_attention_types)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = (choice.num_key_value_heads(self.num_attention_heads) if choice
                                        else self.num_attention_heads)
        if self.layer_types is None:
            self.layer_types = [FULL] * self.num_hidden_layers
        if self.fusion_iterative_init is None:
            self.fusion_iterative_init = [0.5, 0.5]
        super().__post_init__(**kwargs)
        self.check()

    def check(self) -> None:
        """Raise ValueError naming the offending field and the fix."""
        def need(cond: bool, msg: str):
            if not cond:
                raise ValueError(msg)

        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings"):
            v = getattr(self, name)
            need(isinstance(v, int) and v > 0, f"{name}={v!r}: must be a positive integer")
        need(
            self.head_dim is not None,
            f"head_dim is unset and hidden_size={self.hidden_size} is not divisible by num_attention_heads="
            f"{self.num_attention_heads}; set head_dim explicitly",
        )
        need(
            self.head_dim > 0 and self.head_dim % 2 == 0,
            f"head_dim={self.head_dim}: RoPE rotates channel pairs, so head_dim must be a positive even number",
        )
        need(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"num_attention_heads={self.num_attention_heads} is not divisible by num_key_value_heads="
            f"{self.num_key_value_heads}; each KV head must serve the same number of query heads",
        )
        need(
            self.kv_sharing in (*PLAN_NAMES, CUSTOM),
            f"kv_sharing={self.kv_sharing!r}: unknown plan; choose one of {', '.join(PLAN_NAMES)} or {CUSTOM!r} "
            "with a kv_source_map",
        )
        need(
            (self.kv_sharing == CUSTOM) == (self.kv_source_map is not None),
            "kv_source_map is given only with kv_sharing='custom' (and kv_sharing='custom' needs a kv_source_map)",
        )
        need(self.fusion_init in FUSION_INITS, f"fusion_init={self.fusion_init!r}: choose one of {FUSION_INITS}")
        need(
            len(self.layer_types) == self.num_hidden_layers,
            f"layer_types has {len(self.layer_types)} entries for num_hidden_layers={self.num_hidden_layers}",
        )
        need(
            all(t in ATTENTION_TYPES for t in self.layer_types),
            f"layer_types: entries must be in {ATTENTION_TYPES}",
        )
        need(
            "sliding_attention" not in self.layer_types or (self.sliding_window or 0) > 0,
            "layer_types has sliding_attention layers but sliding_window is not a positive integer",
        )
        need(
            "sliding_attention" not in self.layer_types or self.sliding_window < self.max_position_embeddings,
            f"sliding_window={self.sliding_window} is not below max_position_embeddings="
            f"{self.max_position_embeddings}: the window would cover the whole context; lower sliding_window or "
            "make those layers full_attention",
        )
        need(
            "sliding_attention" not in self.layer_types or self.kv_lora_rank is None,
            "sliding-window layers are not implemented with MLA (kv_lora_rank is set); use full_attention layers",
        )
        need(
            len(self.fusion_iterative_init) == 2,
            "fusion_iterative_init must be [carry, fixed], the two coefficients of the iterative recurrence",
        )
        self._check_moe(need)
        self._check_mla(need)
        plan = self.plan  # builds and validates the source map
        if self.fusion_init == "iterative":
            for layer in plan.layers:
                if not layer.stores:
                    need(
                        layer.k_fusion == layer.v_fusion == "channel" and len(layer.k_sources) == 2
                        and len(layer.v_sources) == 2,
                        f"fusion_init='iterative' needs two-source channel fusion in every reconstruction layer; "
                        f"layer {layer.index + 1} is not (use kv_sharing='fusedkv')",
                    )

    def _check_moe(self, need) -> None:
        need(isinstance(self.num_experts, int) and self.num_experts >= 0,
             f"num_experts={self.num_experts!r}: must be 0 (dense MLP) or a positive number of experts")
        if self.num_experts == 0:
            return
        need(
            isinstance(self.num_experts_per_tok, int) and 1 <= self.num_experts_per_tok <= self.num_experts,
            f"num_experts_per_tok={self.num_experts_per_tok!r}: each token is routed to between 1 and "
            f"num_experts={self.num_experts} experts; lower num_experts_per_tok or raise num_experts",
        )
        for name in ("moe_intermediate_size", "decoder_sparse_step"):
            v = getattr(self, name)
            need(isinstance(v, int) and v > 0, f"{name}={v!r}: must be a positive integer")
        bad = [i for i in (self.mlp_only_layers or []) if not 0 <= i < self.num_hidden_layers]
        need(not bad, f"mlp_only_layers={self.mlp_only_layers}: entries are 0-based layer indices below "
                      f"num_hidden_layers={self.num_hidden_layers}; {bad} are not")
        need(self.router_aux_loss_coef >= 0, f"router_aux_loss_coef={self.router_aux_loss_coef}: must be >= 0")

    def _check_mla(self, need) -> None:
        if self.kv_lora_rank is None:
            return
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            v = getattr(self, name)
            need(isinstance(v, int) and v > 0, f"{name}={v!r}: MLA needs a positive integer")
        need(self.q_lora_rank is None or (isinstance(self.q_lora_rank, int) and self.q_lora_rank > 0),
             f"q_lora_rank={self.q_lora_rank!r}: a positive integer, or None for a full-rank query projection")
        need(self.qk_rope_head_dim % 2 == 0,
             f"qk_rope_head_dim={self.qk_rope_head_dim}: RoPE rotates channel pairs, so it must be even")
        need(self.head_dim == self.qk_rope_head_dim,
             f"head_dim={self.head_dim}: with MLA head_dim is the RoPE width and must equal qk_rope_head_dim="
             f"{self.qk_rope_head_dim}; leave head_dim unset")
        heads = self.num_attention_heads
        need(
            self.kv_lora_rank < heads * (self.qk_nope_head_dim + self.v_head_dim),
            f"kv_lora_rank={self.kv_lora_rank} does not compress: the latent must be smaller than the "
            f"{heads * (self.qk_nope_head_dim + self.v_head_dim)} K/V channels it expands to "
            "(num_attention_heads * (qk_nope_head_dim + v_head_dim)); lower kv_lora_rank",
        )
        need(self.fusion_init != "iterative",
             "fusion_init='iterative' is not implemented for MLA; use 'equivalent' (the same starting point)")
        for layer in self.plan.layers:
            # The latent yields both the keys and the values, so "K from one layer, V from another"
            # (fusedkv-lite, the reversed plan) has no MLA counterpart (paper App. A.6).
            need(
                layer.stores or (layer.k_sources == layer.v_sources and layer.k_fusion == layer.v_fusion),
                f"layer {layer.index + 1} reads K from layers {[s + 1 for s in layer.k_sources]} and V from "
                f"{[s + 1 for s in layer.v_sources]}: with MLA (kv_lora_rank set) keys and values come from one "
                "shared latent, so a layer must take K and V from the same sources with the same fusion; "
                "fusedkv-lite does not apply to MLA, use fusedkv, yoco, cla or fusedkv-dense",
            )
        need(
            self.q_lora_rank is None or self.q_lora_rank < heads * (self.qk_nope_head_dim + self.qk_rope_head_dim),
            f"q_lora_rank={self.q_lora_rank} is not below the query width num_attention_heads * "
            f"(qk_nope_head_dim + qk_rope_head_dim) = {heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)}; "
            "lower it or set q_lora_rank=None",
        )
        need(
            self.num_key_value_heads == heads,
            f"num_key_value_heads={self.num_key_value_heads}: MLA gives every query head its own key and value "
            f"from the shared latent, so it must equal num_attention_heads={heads} (the latent replaces GQA)",
        )

    @property
    def plan(self) -> KVSharingPlan:
        """The validated plan (recomputed on access: it is cheap, and configs must stay JSON-serialisable)."""
        if self.kv_sharing == CUSTOM:
            return custom_plan(self.num_hidden_layers, self.kv_source_map, self.layer_types)
        return build_plan(self.kv_sharing, self.num_hidden_layers, self.layer_types, self.shared_attention_types)

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters["rope_theta"])

    def kv_cache_bytes_per_token(self, bytes_per_element: int = 2, context: int | None = None) -> float:
        """Bytes of KV cache one token occupies, per sequence (2 * L * H_kv * D for vanilla, paper Table 1).

        With `context`, the average over a sequence of that many tokens: a sliding-window storage layer
        holds only the last `sliding_window` tokens (paper App. A.6), so its share shrinks as the context
        grows. Without it every storage layer counts in full (exact for models without window layers)."""
        if self.kv_lora_rank is not None:  # MLA: the latent and the RoPE key, once per storage layer
            return len(self.plan.storage_layers) * (self.kv_lora_rank + self.qk_rope_head_dim) * bytes_per_element
        per_layer = 2 * self.num_key_value_heads * self.head_dim * bytes_per_element
        plan = self.plan
        if context is None or SLIDING not in self.layer_types:
            return len(plan.storage_layers) * per_layer
        held = sum(min(context, self.sliding_window) if plan.layers[i].attention_type == SLIDING else context
                   for i in plan.storage_layers)
        return per_layer * held / context

    def mha_kv_cache_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """The baseline of every cache ratio: multi-head attention of the same shape (same layers, one KV
        head per query head, same head_dim, every layer storing), 2 * L * H_q * D elements per token."""
        if self.kv_lora_rank is not None:  # MLA: the MHA it expands to, keys of nope+rope and values of v channels
            width = self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim
            return self.num_hidden_layers * self.num_attention_heads * width * bytes_per_element
        return 2 * self.num_hidden_layers * self.num_attention_heads * self.head_dim * bytes_per_element

    def kv_cache_fraction(self, context: int | None = None) -> float:
        """KV-cache size relative to MHA of the same shape (`mha_kv_cache_bytes_per_token`): 0.5 for
        FusedKV or GQA, 0.25 for FusedKV with half the KV heads. The one cache ratio the CLI, the
        training summary, the comparisons and the benchmarks report. With sliding-window layers it
        depends on the context length (default: max_position_embeddings)."""
        context = context or self.max_position_embeddings
        return self.kv_cache_bytes_per_token(1, context) / self.mha_kv_cache_bytes_per_token(1)


__all__ = ["FusedKVConfig"]
