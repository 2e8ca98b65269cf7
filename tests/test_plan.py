"""The KV-sharing plan: structure, capacity and I/O (paper Table 1), custom maps and their errors."""

import pytest

from fusedkv.plan import FULL, PLAN_NAMES, SLIDING, build_plan, split_point
from fusedkv.source_map import custom_plan


def ratios(name, layers=16):
    plan, vanilla = build_plan(name, layers), build_plan("vanilla", layers)
    return (plan.cache_elements_per_token() / vanilla.cache_elements_per_token(),
            plan.elements_read_per_token() / vanilla.elements_read_per_token())


def test_spec_table_capacity_and_io():
    assert ratios("vanilla") == (1.0, 1.0)
    assert ratios("yoco") == (0.5, 1.0)
    assert ratios("fusedkv-lite") == (0.5, 1.0)
    assert ratios("fusedkv") == (0.5, 1.5)
    assert ratios("cla")[0] == 0.5


def test_named_plans_sources_are_paper_layers():
    lite = build_plan("fusedkv-lite", 16)
    assert lite.storage_layers == tuple(range(8))
    for i in range(8, 16):  # K^8, V^1 in the paper's 1-based numbering
        assert lite.layers[i].k_sources == (7,) and lite.layers[i].v_sources == (0,)
    fused = build_plan("fusedkv", 16)
    assert all(fused.layers[i].k_sources == (0, 7) and fused.layers[i].k_fusion == "channel" for i in range(8, 16))
    yoco = build_plan("yoco", 8)
    assert all(yoco.layers[i].k_sources == yoco.layers[i].v_sources == (3,) for i in range(4, 8))
    cla = build_plan("cla", 6)
    assert cla.storage_layers == (0, 2, 4) and cla.layers[5].k_sources == (4,)
    assert build_plan("fusedkv", 8).first_skippable_layer == 4
    assert build_plan("cla", 8).first_skippable_layer == 7
    assert build_plan("vanilla", 8).first_skippable_layer == 8


def test_custom_maps_for_the_ablations():
    # Table 17: K source 5, V source 1 on a 16-layer model; reversed Lite K^1, V^8; single-source scaling.
    p = custom_plan(16, [{"layers": [9, 16], "k": 5, "v": 1}])
    assert p.layers[8].k_sources == (4,) and p.layers[15].v_sources == (0,) and p.storage_layers == tuple(range(8))
    rev = custom_plan(16, [{"layers": [9, 16], "k": 1, "v": 8}])
    assert rev.layers[10].k_sources == (0,) and rev.layers[10].v_sources == (7,)
    scaled = custom_plan(16, [{"layers": [9, 16], "k": 8, "v": 1, "k_fusion": "channel", "v_fusion": "channel"}])
    assert scaled.layers[9].k_fusion == "channel" and len(scaled.layers[9].k_sources) == 1
    fused = custom_plan(8, [{"layers": [5, 8], "k": [1, 4], "v": [1, 4]}])
    assert fused.layers[5].k_fusion == "channel"
    assert fused == custom_plan(8, [{"layers": [5, 8], "k": [1, 4], "v": [1, 4], "k_fusion": "channel",
                                     "v_fusion": "channel"}])


@pytest.mark.parametrize("source_map, match", [
    ([{"layers": [5, 8], "k": 6, "v": 1}], "not a storage layer"),
    ([{"layers": [5, 8], "k": 9, "v": 1}], "outside 1..8"),
    ([{"layers": [5, 8], "k": [1, 2], "v": 1, "k_fusion": "reuse"}], "without fusion"),
    ([{"layers": [5, 8], "k": 1}], "needs keys"),
    ([{"layers": [3, 3], "k": 4, "v": 4}], "comes after"),
])
def test_custom_map_errors(source_map, match):
    with pytest.raises(ValueError, match=match):
        custom_plan(8, source_map)


@pytest.mark.parametrize("layers", [3, 5, 7, 27, 61])
@pytest.mark.parametrize("name", PLAN_NAMES)
def test_odd_layer_counts_keep_the_middle_layer(name, layers):
    """Odd L (DeepSeek-V3: 61, V2-Lite: 27): the lower ceil(L/2) layers keep their caches, so layer n = (L+1)/2,
    the middle one, is a source; every upper layer reads only layers below it; the cache is (L+1)/(2L)."""
    plan, n = build_plan(name, layers), (layers + 1) // 2
    assert split_point(layers) == n
    if name == "vanilla":
        assert plan.storage_layers == tuple(range(layers))
        return
    if name == "cla":  # pairs, the odd last layer on its own
        assert plan.storage_layers == tuple(range(0, layers, 2))
        assert all(plan.layers[i].k_sources == (i - 1,) for i in range(1, layers, 2))
    else:
        assert plan.storage_layers == tuple(range(n)) and plan.reconstruction_layers == tuple(range(n, layers))
        k_sources = {"yoco": (n - 1,), "fusedkv-lite": (n - 1,), "fusedkv": (0, n - 1),
                     "fusedkv-dense": tuple(range(n))}[name]
        v_sources = {"yoco": (n - 1,), "fusedkv-lite": (0,)}.get(name, k_sources)
        for i in range(n, layers):
            assert plan.layers[i].k_sources == k_sources and plan.layers[i].v_sources == v_sources
    assert all(max(layer.sources) < layer.index for layer in plan.layers if not layer.stores)
    assert plan.cache_elements_per_token() / build_plan("vanilla", layers).cache_elements_per_token() == n / layers


def test_odd_layer_hybrid_and_smallest_models():
    # A 7-layer window/full hybrid: lower 4 layers keep caches; each upper layer reads its own type below it.
    types = [SLIDING, SLIDING, FULL] * 2 + [SLIDING]
    plan = build_plan("fusedkv", 7, types)
    assert plan.storage_layers == (0, 1, 2, 3)
    assert plan.layers[5].k_sources == (2,) and plan.layers[6].k_sources == (0, 3)
    assert build_plan("fusedkv", 3).layers[2].k_sources == (0, 1)
    assert build_plan("yoco", 2).layers[1].k_sources == (0,)
    for name in PLAN_NAMES[1:]:
        if name != "cla":
            with pytest.raises(ValueError, match="at least 2 layers"):
                build_plan(name, 1)
    with pytest.raises(ValueError, match="unknown kv_sharing plan"):
        build_plan("mqa", 8)


def test_hybrid_window_plans_take_sources_of_their_own_type():
    # Paper App. A.6 (SWA hybrid): groups of four, three window layers then one full layer.
    types = [SLIDING, SLIDING, SLIDING, FULL] * 4
    wf = build_plan("fusedkv", 16, types)
    for layer in wf.layers[8:]:
        assert all(types[s] == layer.attention_type for s in layer.k_sources + layer.v_sources)
    assert wf.layers[11].k_sources == (3, 7)  # full layers fuse the lower full layers 4 and 8
    w_only = build_plan("fusedkv", 16, types, shared_types=[SLIDING])
    assert w_only.layers[11].stores and not w_only.layers[8].stores
    with pytest.raises(ValueError, match="cannot read a window cache"):
        custom_plan(16, [{"layers": [12, 12], "k": 1, "v": 1}], types)
    # a window layer may read a full cache (its own mask applies the window), but not full and window caches at once
    assert custom_plan(16, [{"layers": 10, "k": 4, "v": 8}], types).layers[9].k_sources == (3,)
    with pytest.raises(ValueError, match="sources must be of one attention type"):
        custom_plan(16, [{"layers": 10, "k": 4, "v": 1}], types)


def test_window_layers_above_a_full_lower_half_read_full_layers():
    """Qwen2/Qwen3 with use_sliding_window and max_window_layers = L/2: the lower half is full attention, the
    upper half windowed. The upper window layers fuse the lower full layers (decode against the full forward:
    tests/convert/test_window_over_full.py)."""
    types = [FULL] * 4 + [SLIDING] * 4
    plan = build_plan("fusedkv", 8, types)
    assert plan.storage_layers == (0, 1, 2, 3)
    assert all(plan.layers[i].k_sources == (0, 3) for i in range(4, 8))
    assert build_plan("yoco", 8, types).layers[7].k_sources == (3,)
    with pytest.raises(ValueError, match="lower half has no full_attention layer"):
        build_plan("fusedkv", 8, [SLIDING] * 4 + [FULL] * 4)


def test_user_shorthands_resolve_in_one_place():
    from fusedkv import FusedKVConfig
    from fusedkv.plan import resolve_plan_choice

    def resolved(name):
        c = resolve_plan_choice(name)
        return c.sharing, c.query_heads_per_kv_head, c.shared_attention_types

    assert resolved("gqa") == ("vanilla", 2, None)
    assert resolved("fusedkv+gqa") == ("fusedkv", 2, None)
    assert resolved("fusedkv+W") == ("fusedkv", None, (SLIDING,))
    assert resolved("fusedkv+gqa+WF") == ("fusedkv", 2, (SLIDING, FULL))
    for bad in ("gqa+gqa", "fusedkv+W+WF", "fusedkv+x", "mla", "gqa+W"):
        with pytest.raises(ValueError, match="unknown plan"):
            resolve_plan_choice(bad)
    shape = dict(num_hidden_layers=8, hidden_size=64, num_attention_heads=4)
    c = FusedKVConfig(**shape, kv_sharing="fusedkv+gqa")
    assert (c.kv_sharing, c.num_key_value_heads, c.kv_cache_fraction()) == ("fusedkv", 2, 0.25)
    legacy = FusedKVConfig.from_dict({**FusedKVConfig(**shape, kv_sharing="vanilla").to_dict(), "kv_sharing": "gqa",
                                      "num_key_value_heads": 2})  # what older checkpoints saved
    assert (legacy.kv_sharing, legacy.num_key_value_heads) == ("vanilla", 2)
    hybrid = FusedKVConfig(**shape, kv_sharing="fusedkv+W", layer_types=[SLIDING, SLIDING, SLIDING, FULL] * 2,
                           sliding_window=4)
    assert hybrid.shared_attention_types == [SLIDING] and hybrid.plan.layers[7].stores


def test_train_compare_and_plans_report_one_cache_ratio():
    # One baseline (MHA of the same shape) everywhere: FusedKV with half the KV heads is 0.25 in the
    # training summary, the comparison tables and the plans table alike.
    from fusedkv import FusedKVConfig
    from fusedkv.commands.plans import plans_table
    from fusedkv.train.trainer import kv_cache_report

    cfg = FusedKVConfig(num_hidden_layers=8, hidden_size=64, num_attention_heads=4, kv_sharing="fusedkv",
                        num_key_value_heads=2)
    assert kv_cache_report(cfg)["kv_cache_ratio"] == cfg.kv_cache_fraction() == 0.25
    rows = {r.split("|")[1].strip(): r.split("|")[4].strip() for r in plans_table(8, 4, 2, 16, 64, 2).splitlines()[2:]}
    assert rows["fusedkv"] == "0.25" and rows["gqa"] == "0.5" and rows["vanilla"] == "0.5"
