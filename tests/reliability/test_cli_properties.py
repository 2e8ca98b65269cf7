"""Property-based tests (hypothesis) of what the command line hands to the library: any FusedKVConfig
keyword arguments (what `--set model.KEY=VALUE` and config files reach), any custom source map, any plan
for any layer count, and any text for a flag's type, either give a valid object or raise ValueError
(reported as one line, exit 2) - never another exception, which the CLI would call a bug."""

from __future__ import annotations

import argparse
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusedkv import argtypes
from fusedkv.config import FusedKVConfig
from fusedkv.plan import CUSTOM, PLAN_CHOICES, build_plan, resolve_plan_choice
from fusedkv.source_map import custom_plan

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "initializer_range",
          "kv_sharing", "kv_source_map", "fusion_init", "fusion_iterative_init", "layer_types", "sliding_window",
          "num_experts", "num_experts_per_tok", "moe_intermediate_size", "mlp_only_layers", "kv_lora_rank",
          "q_lora_rank", "qk_rope_head_dim", "rope_theta", "tie_word_embeddings", "attention_dropout")

small_int = st.integers(-2, 40)
junk = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                 st.text(max_size=6), st.lists(small_int, max_size=3), st.dictionaries(st.text(max_size=3), small_int,
                                                                                       max_size=2))
source_entry = st.fixed_dictionaries(
    {"layers": st.one_of(small_int, st.lists(small_int, min_size=1, max_size=3)),
     "k": st.one_of(small_int, st.lists(small_int, max_size=3)),
     "v": st.one_of(small_int, st.lists(small_int, max_size=3))},
    optional={"k_fusion": st.sampled_from(["reuse", "channel", "scalar", "bogus"]),
              "v_fusion": st.sampled_from(["reuse", "channel", "scalar", "bogus"])})
value = {
    "kv_sharing": st.one_of(st.sampled_from([*PLAN_CHOICES, CUSTOM, "fusedkv+gqa", "bogus", ""]), junk),
    "kv_source_map": st.one_of(st.none(), st.lists(source_entry, max_size=3), junk),
    "fusion_init": st.one_of(st.sampled_from(["equivalent", "normal", "iterative"]), junk),
    "layer_types": st.one_of(st.none(), st.lists(st.sampled_from(["full_attention", "sliding_attention", "x"]),
                                                 max_size=8), junk),
}


@st.composite
def config_kwargs(draw):
    names = draw(st.lists(st.sampled_from(FIELDS), unique=True, max_size=6))
    return {n: draw(value.get(n, st.one_of(small_int, junk))) for n in names}


@pytest.mark.slow
@SETTINGS
@given(config_kwargs())
def test_any_config_kwargs_construct_or_raise_value_error(kwargs):
    try:
        cfg = FusedKVConfig(**kwargs)
    except ValueError:
        return
    # Valid: the plan it implies is consistent with the config.
    plan = cfg.plan
    assert plan.num_layers == cfg.num_hidden_layers
    assert all(s in plan.storage_layers for i in plan.reconstruction_layers for s in plan.layers[i].sources)


@pytest.mark.slow
@SETTINGS
@given(st.integers(-3, 64), st.lists(source_entry, max_size=4))
def test_any_source_map_builds_a_consistent_plan_or_raises_value_error(num_layers, source_map):
    try:
        plan = custom_plan(num_layers, source_map)
    except ValueError:
        return
    assert plan.num_layers == num_layers
    for i in plan.reconstruction_layers:
        assert all(s < i and s in plan.storage_layers for s in plan.layers[i].sources)


@SETTINGS
@given(st.one_of(st.sampled_from([*PLAN_CHOICES, CUSTOM]), st.text(max_size=8)), st.integers(-3, 200))
def test_any_plan_name_and_layer_count(name, num_layers):
    try:
        sharing = resolve_plan_choice(name).sharing
        plan = build_plan(sharing, num_layers)
    except ValueError:
        return
    assert plan.num_layers == num_layers and plan.storage_layers


@SETTINGS
@given(st.text(max_size=12))
def test_flag_types_accept_or_raise_argument_type_error(text):
    for parse in (argtypes.positive_int, argtypes.non_negative_int, argtypes.int_range(2, 4096),
                  argtypes.positive_float, argtypes.float_range(0, 1, lo_open=True), argtypes.int_list(1),
                  argtypes.name_list(), argtypes.non_empty):
        try:
            got = parse(text)
        except argparse.ArgumentTypeError:
            continue
        if isinstance(got, float):
            assert math.isfinite(got)
        if isinstance(got, int) and not isinstance(got, bool):
            assert -(2**31) <= got <= argtypes.INT_MAX
