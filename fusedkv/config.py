"""`FusedKVConfig`: a Qwen3-style decoder configuration plus the KV-sharing plan.

Field names follow transformers' `Qwen3Config` so converted checkpoints and tools that read Qwen3
configs keep working. The plan is given by name (`kv_sharing`) or by a custom 1-based source map
(`kv_source_map`); `config.plan` turns either into a validated `KVSharingPlan`.

Every invalid combination raises `ValueError` naming the field and the fix, at construction time, so
bad configs never reach torch: field types here, every other check in `fusedkv.config_fields`.
"""

from __future__ import annotations

import functools
import inspect
import operator
import types
import typing

from huggingface_hub.dataclasses import strict, type_validator
from transformers import PreTrainedConfig

from .config_fields import MAX_LAYERS, check_config, rope_parameters_by_type
from .plan import (
    CUSTOM,
    DEFAULT_PLAN,
    FULL,
    PLAN_NAMES,
    SLIDING,
    KVSharingPlan,
    build_plan,
    resolve_plan_choice,
)
from .source_map import custom_plan


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
    rope_interleave: the RoPE rows of q and k_R hold interleaved pairs (DeepSeek checkpoints) rather than
    rotate-half halves. Scaled RoPE (`rope_parameters` with a `rope_type` such as "yarn") follows
    transformers; with MLA a YaRN `mscale_all_dim` also scales the softmax, as in DeepSeek-V2/V3.

    DeepSeekMoE (DeepSeek-V2/V3's names; the defaults are Qwen3-MoE's routing): n_shared_experts (always-on
    experts of moe_intermediate_size * n_shared_experts channels beside the routed ones), topk_method
    ("greedy": top-k of the softmax; "group_limited_greedy": top-k within the topk_group of n_group expert
    groups with the highest softmax maximum, DeepSeek-V2; "noaux_tc": sigmoid scores, experts chosen on
    scores + the router's e_score_correction_bias within the topk_group groups of highest top-2 sum,
    DeepSeek-V3), n_group, topk_group, routed_scaling_factor (multiplies the routed experts' weights).
    The dense layers before the first sparse one (first_k_dense_replace) are `mlp_only_layers`.
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
    # ---- DeepSeekMoE routing and shared experts (DeepSeek-V2/V3's names; `fusedkv/model/moe.py`) ----
    n_shared_experts: int = 0
    topk_method: str = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    rope_interleave: bool = False  # MLA's RoPE channels in DeepSeek's interleaved-pair layout (`model/mla.py`)
    # ---- Imported families' features (fusedkv/convert): transformers' field names where a family has one;
    # ---- the defaults are Qwen3's, so models and checkpoints made before these fields are unchanged.
    mlp_bias: bool = False  # Llama: biases on the MLP projections
    attention_output_bias: bool | None = None  # bias on o_proj; None = attention_bias (Qwen2: Q/K/V only)
    use_qk_norm: bool = True  # RMSNorm on each query and key head before RoPE (Qwen3, Gemma 3; not Llama)
    query_pre_attn_scalar: float | int | None = None  # Gemma: scores scaled by its -1/2 power; None = head_dim
    attn_logit_softcapping: float | int | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | int | None = None  # Gemma 2/3: logits -> cap * tanh(logits / cap)
    embedding_multiplier: float | int = 1.0  # Gemma: sqrt(hidden_size), in the embeddings' dtype (Granite's name)
    rms_norm_unit_offset: bool = False  # Gemma's RMSNorm: x / rms(x) * (1 + w), weights stored around 0
    use_post_norms: bool = False  # Gemma 2/3: RMSNorm on the attention and MLP outputs before each residual add

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
            if choice.query_heads_per_kv_head is not None and self.kv_lora_rank is not None:
                raise ValueError(f"kv_sharing={self.kv_sharing!r}: +gqa halves the KV heads, which MLA (kv_lora_rank "
                                 f"set) does not have: its one latent serves every head; use {choice.sharing!r}")
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
        """Raise ValueError naming the offending field and the fix (`fusedkv.config_fields.check_config`)."""
        check_config(self)

    def extra_block_features(self) -> list[str]:
        """The imported families' fields this config sets away from the Qwen3 block (defaults): what the
        paths that implement only that block (the native CPU decode step, the vLLM plugin) must decline."""
        rope = list(rope_parameters_by_type(self).values())
        on = {"mlp_bias": self.mlp_bias,
              "attention_output_bias": self.attention_output_bias not in (None, self.attention_bias),
              "use_qk_norm": not self.use_qk_norm, "query_pre_attn_scalar": self.query_pre_attn_scalar is not None,
              "attn_logit_softcapping": self.attn_logit_softcapping is not None,
              "final_logit_softcapping": self.final_logit_softcapping is not None,
              "embedding_multiplier": self.embedding_multiplier != 1.0,
              "rms_norm_unit_offset": self.rms_norm_unit_offset, "use_post_norms": self.use_post_norms,
              "rope_parameters": len(rope) > 1 or rope[0].get("rope_type", "default") != "default"}
        return [name for name, set_ in on.items() if set_]

    @property
    def plan(self) -> KVSharingPlan:
        """The validated plan (recomputed on access: it is cheap, and configs must stay JSON-serialisable)."""
        if self.kv_sharing == CUSTOM:
            return custom_plan(self.num_hidden_layers, self.kv_source_map, self.layer_types)
        return build_plan(self.kv_sharing, self.num_hidden_layers, self.layer_types, self.shared_attention_types)

    @property
    def rope_theta(self) -> float:
        """The RoPE base (of the full-attention layers where each attention type has its own RoPE)."""
        params = self.rope_parameters
        return float(params[FULL]["rope_theta"] if FULL in params else params["rope_theta"])

    def kv_cache_bytes_per_token(self, bytes_per_element: int = 2, context: int | None = None) -> float:
        """Bytes of KV cache one token occupies, per sequence (2 * L * H_kv * D for vanilla, paper Table 1).

        With `context`, the average over a sequence of that many tokens: a sliding-window storage layer
        holds only the last `sliding_window - 1` tokens (paper App. A.6), so its share shrinks as the context
        grows. Without it every storage layer counts in full (exact for models without window layers)."""
        if self.kv_lora_rank is not None:  # MLA: the latent and the RoPE key, once per storage layer
            return len(self.plan.storage_layers) * (self.kv_lora_rank + self.qk_rope_head_dim) * bytes_per_element
        per_layer = 2 * self.num_key_value_heads * self.head_dim * bytes_per_element
        plan = self.plan
        if context is None or SLIDING not in self.layer_types:
            return len(plan.storage_layers) * per_layer
        # A window layer's cache holds the last W - 1 tokens (the query's own token makes W), as
        # StaticKVCache and transformers' DynamicSlidingWindowLayer do.
        held = sum(min(context, self.sliding_window - 1) if plan.layers[i].attention_type == SLIDING else context
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
