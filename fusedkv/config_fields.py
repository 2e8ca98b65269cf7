"""What a `FusedKVConfig`'s fields may hold: the choices (fusion initialisations, activations, RoPE types, MoE
routing methods), the RoPE parameters per attention type, and `check_config`, which refuses every invalid
combination with a ValueError naming the field and the fix (the config calls it at construction, so bad configs
never reach torch). Field types are checked by the config itself (`fusedkv.config`), before these.
"""

from __future__ import annotations

from .plan import ATTENTION_TYPES, CUSTOM, FULL, PLAN_NAMES, SLIDING

FUSION_INITS = ("equivalent", "normal", "iterative")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")  # DeepSeekMoE routing
MAX_LAYERS = 4096


# `hidden_act` values the MLP computes exactly as transformers' ACT2FN does (the same functions); others
# (parametrised or clipped ones) are refused at config time.
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_python",
               "gelu_python_tanh", "gelu_accurate", "quick_gelu", "relu", "relu2", "sigmoid", "tanh")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")  # longrope's switching is not reproduced


def rope_parameters_by_type(config) -> dict[str | None, dict]:
    """{attention type: its RoPE parameters}: one entry (key None) when every layer shares one RoPE, else
    one per attention type (Gemma 3: a separate base for the sliding layers), transformers' layout of
    `rope_parameters`. Raises ValueError for a RoPE fusedkv does not compute."""
    params = config.rope_parameters
    by_type = {t: params[t] for t in (FULL, SLIDING) if t in params} or {None: params}
    for key, p in by_type.items():
        where = "rope_parameters" + (f"[{key!r}]" if key else "")
        if not isinstance(p, dict) or "rope_theta" not in p:
            raise ValueError(f"{where}={p!r}: expected a dict with rope_type and rope_theta")
        if p.get("rope_type", "default") not in ROPE_TYPES:
            raise ValueError(f"{where}: rope_type {p.get('rope_type')!r} is not supported; one of {ROPE_TYPES}")
        if p.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{where}: partial_rotary_factor={p['partial_rotary_factor']} is not supported")
    return by_type


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_config(config) -> None:
    """Raise ValueError naming the offending field of `config` and the fix."""
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "max_position_embeddings"):
        v = getattr(config, name)
        _need(isinstance(v, int) and v > 0, f"{name}={v!r}: must be a positive integer")
    _need(
        config.head_dim is not None,
        f"head_dim is unset and hidden_size={config.hidden_size} is not divisible by num_attention_heads="
        f"{config.num_attention_heads}; set head_dim explicitly",
    )
    _need(
        config.head_dim > 0 and config.head_dim % 2 == 0,
        f"head_dim={config.head_dim}: RoPE rotates channel pairs, so head_dim must be a positive even number",
    )
    _need(
        config.num_attention_heads % config.num_key_value_heads == 0,
        f"num_attention_heads={config.num_attention_heads} is not divisible by num_key_value_heads="
        f"{config.num_key_value_heads}; each KV head must serve the same number of query heads",
    )
    _need(
        config.kv_sharing in (*PLAN_NAMES, CUSTOM),
        f"kv_sharing={config.kv_sharing!r}: unknown plan; choose one of {', '.join(PLAN_NAMES)} or {CUSTOM!r} "
        "with a kv_source_map",
    )
    _need(
        (config.kv_sharing == CUSTOM) == (config.kv_source_map is not None),
        "kv_source_map is given only with kv_sharing='custom' (and kv_sharing='custom' needs a kv_source_map)",
    )
    _need(config.fusion_init in FUSION_INITS, f"fusion_init={config.fusion_init!r}: choose one of {FUSION_INITS}")
    _need(
        len(config.layer_types) == config.num_hidden_layers,
        f"layer_types has {len(config.layer_types)} entries for num_hidden_layers={config.num_hidden_layers}",
    )
    _need(
        all(t in ATTENTION_TYPES for t in config.layer_types),
        f"layer_types: entries must be in {ATTENTION_TYPES}",
    )
    _need(
        "sliding_attention" not in config.layer_types or (config.sliding_window or 0) > 0,
        "layer_types has sliding_attention layers but sliding_window is not a positive integer",
    )
    _need(
        "sliding_attention" not in config.layer_types or config.sliding_window < config.max_position_embeddings,
        f"sliding_window={config.sliding_window} is not below max_position_embeddings="
        f"{config.max_position_embeddings}: the window would cover the whole context; lower sliding_window or "
        "make those layers full_attention",
    )
    _need(
        "sliding_attention" not in config.layer_types or config.kv_lora_rank is None,
        "sliding-window layers are not implemented with MLA (kv_lora_rank is set); use full_attention layers",
    )
    _need(
        len(config.fusion_iterative_init) == 2,
        "fusion_iterative_init must be [carry, fixed], the two coefficients of the iterative recurrence",
    )
    _check_moe(config)
    _check_mla(config)
    _check_family_features(config)
    plan = config.plan  # builds and validates the source map
    if config.fusion_init == "iterative":
        for layer in plan.layers:
            if not layer.stores:
                _need(
                    layer.channel_weighted and len(layer.k_sources) == 2
                    and len(layer.v_sources) == 2,
                    f"fusion_init='iterative' needs two-source channel fusion in every reconstruction layer; "
                    f"layer {layer.index + 1} is not (use kv_sharing='fusedkv')",
                )

def _check_moe(config) -> None:
    _need(isinstance(config.num_experts, int) and config.num_experts >= 0,
         f"num_experts={config.num_experts!r}: must be 0 (dense MLP) or a positive number of experts")
    if config.num_experts == 0:
        return
    _need(
        isinstance(config.num_experts_per_tok, int) and 1 <= config.num_experts_per_tok <= config.num_experts,
        f"num_experts_per_tok={config.num_experts_per_tok!r}: each token is routed to between 1 and "
        f"num_experts={config.num_experts} experts; lower num_experts_per_tok or raise num_experts",
    )
    for name in ("moe_intermediate_size", "decoder_sparse_step"):
        v = getattr(config, name)
        _need(isinstance(v, int) and v > 0, f"{name}={v!r}: must be a positive integer")
    bad = [i for i in (config.mlp_only_layers or []) if not 0 <= i < config.num_hidden_layers]
    _need(not bad, f"mlp_only_layers={config.mlp_only_layers}: entries are 0-based layer indices below "
                  f"num_hidden_layers={config.num_hidden_layers}; {bad} are not")
    _need(config.router_aux_loss_coef >= 0, f"router_aux_loss_coef={config.router_aux_loss_coef}: must be >= 0")
    _check_routing(config)

# ---- DeepSeekMoE routing (the fields of the block above) --------------------------------------------
def _check_routing(config) -> None:
    _need(config.topk_method in TOPK_METHODS, f"topk_method={config.topk_method!r}: choose one of {TOPK_METHODS}")
    _need(config.n_shared_experts >= 0, f"n_shared_experts={config.n_shared_experts}: must be >= 0")
    _need(config.routed_scaling_factor > 0, f"routed_scaling_factor={config.routed_scaling_factor}: must be > 0")
    if config.topk_method == "greedy" and config.n_group is None:
        return
    _need(config.topk_method == "greedy" or (config.n_group is not None and config.topk_group is not None),
         f"topk_method={config.topk_method!r} routes within expert groups: set n_group and topk_group")
    groups, chosen = config.n_group or 1, config.topk_group or 1
    _need(groups > 0 and config.num_experts % groups == 0,
         f"n_group={config.n_group}: must be a positive divisor of num_experts={config.num_experts}")
    _need(0 < chosen <= groups, f"topk_group={config.topk_group}: must be between 1 and n_group={groups}")
    per_group = config.num_experts // groups
    _need(config.num_experts_per_tok <= chosen * per_group,
         f"num_experts_per_tok={config.num_experts_per_tok} exceeds the {chosen * per_group} experts in "
         f"topk_group={chosen} groups of {per_group}; raise topk_group or lower num_experts_per_tok")
    _need(config.topk_method != "noaux_tc" or per_group >= 2,
         f"topk_method='noaux_tc' scores each group by its top-2 experts: num_experts / n_group = {per_group} "
         "must be at least 2")

def _check_mla(config) -> None:
    if config.kv_lora_rank is None:
        _need(not config.rope_interleave, "rope_interleave applies to MLA's RoPE key (kv_lora_rank set) only")
        return
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        v = getattr(config, name)
        _need(isinstance(v, int) and v > 0, f"{name}={v!r}: MLA needs a positive integer")
    _need(config.q_lora_rank is None or (isinstance(config.q_lora_rank, int) and config.q_lora_rank > 0),
         f"q_lora_rank={config.q_lora_rank!r}: a positive integer, or None for a full-rank query projection")
    _need(config.qk_rope_head_dim % 2 == 0,
         f"qk_rope_head_dim={config.qk_rope_head_dim}: RoPE rotates channel pairs, so it must be even")
    _need(config.head_dim == config.qk_rope_head_dim,
         f"head_dim={config.head_dim}: with MLA head_dim is the RoPE width and must equal qk_rope_head_dim="
         f"{config.qk_rope_head_dim}; leave head_dim unset")
    heads = config.num_attention_heads
    _need(
        config.kv_lora_rank < heads * (config.qk_nope_head_dim + config.v_head_dim),
        f"kv_lora_rank={config.kv_lora_rank} does not compress: the latent must be smaller than the "
        f"{heads * (config.qk_nope_head_dim + config.v_head_dim)} K/V channels it expands to "
        "(num_attention_heads * (qk_nope_head_dim + v_head_dim)); lower kv_lora_rank",
    )
    _need(config.fusion_init != "iterative",
         "fusion_init='iterative' is not implemented for MLA; use 'equivalent' (the same starting point)")
    for layer in config.plan.layers:
        # The latent yields both the keys and the values, so "K from one layer, V from another"
        # (fusedkv-lite, the reversed plan) has no MLA counterpart (paper App. A.6).
        _need(
            layer.stores or (layer.k_sources == layer.v_sources and layer.k_fusion == layer.v_fusion),
            f"layer {layer.index + 1} reads K from layers {[s + 1 for s in layer.k_sources]} and V from "
            f"{[s + 1 for s in layer.v_sources]}: with MLA (kv_lora_rank set) keys and values come from one "
            "shared latent, so a layer must take K and V from the same sources with the same fusion; "
            "fusedkv-lite does not apply to MLA, use fusedkv, yoco, cla or fusedkv-dense",
        )
    _need(
        config.q_lora_rank is None or config.q_lora_rank < heads * (config.qk_nope_head_dim + config.qk_rope_head_dim),
        f"q_lora_rank={config.q_lora_rank} is not below the query width num_attention_heads * "
        f"(qk_nope_head_dim + qk_rope_head_dim) = {heads * (config.qk_nope_head_dim + config.qk_rope_head_dim)}; "
        "lower it or set q_lora_rank=None",
    )
    _need(
        config.num_key_value_heads == heads,
        f"num_key_value_heads={config.num_key_value_heads}: MLA gives every query head its own key and value "
        f"from the shared latent, so it must equal num_attention_heads={heads} (the latent replaces GQA)",
    )

def _check_family_features(config) -> None:
    _need(config.hidden_act in ACTIVATIONS,
         f"hidden_act={config.hidden_act!r}: supported activations are {', '.join(ACTIVATIONS)}")
    for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
        v = getattr(config, name)
        _need(v is None or v > 0, f"{name}={v!r}: must be positive, or None (off)")
    _need(config.num_experts == 0 or config.hidden_act == "silu",
         f"hidden_act={config.hidden_act!r}: the mixture-of-experts layers compute SiLU experts only")
    _need(config.embedding_multiplier > 0, f"embedding_multiplier={config.embedding_multiplier!r}: must be positive")
    rope_parameters_by_type(config)  # raises ValueError naming what it cannot compute
    _need(config.kv_lora_rank is None or not (config.attn_logit_softcapping or config.use_post_norms
                                           or config.rms_norm_unit_offset or config.query_pre_attn_scalar),
         "attn_logit_softcapping, use_post_norms, rms_norm_unit_offset and query_pre_attn_scalar are not "
         "implemented with MLA (kv_lora_rank is set)")
