"""`KVSources`, the one value a layer attends over: the iterative recurrence unrolled into two-source
weights equals the recurrence run with a carried K/V (values and gradients), and the unrolled model
decodes like its full forward through every engine path."""

import pytest
import torch

from fusedkv.engine import select_runtime
from fusedkv.kernels.reference import fuse_sources
from fusedkv.model.attention import KVState
from tests.conftest import randomize_fusion, tiny_config, tiny_model
from tests.model.test_decode import incremental_logits, padded_batch


def _iterative_model(layers=8):
    from fusedkv import FusedKVForCausalLM

    torch.manual_seed(0)
    model = FusedKVForCausalLM(tiny_config(kv_sharing="fusedkv", num_hidden_layers=layers,
                                           fusion_init="iterative")).double().eval()
    randomize_fusion(model)  # not the tidy initial values: every step's (f, c) differs
    return model


def _carried(model, records):
    """The recurrence as the iterative architecture runs it (paper App. A.3): K^i = c_i (.) K^{i-1} + f_i (.) K^1,
    the carry starting at the second source K^n, one carry per chain of layers reading the same sources."""
    carry, fused = {}, {}
    for layer in model.model.layers:
        attn = layer.self_attn
        if attn.layer.stores:
            continue
        first, second = attn.layer.k_sources
        k_prev, v_prev = carry.get(attn.layer.k_sources, records[second])
        (f_k, c_k), (f_v, c_v) = attn.fusion.key_weights(), attn.fusion.value_weights()
        k = f_k[None, :, None, :] * records[first][0] + c_k[None, :, None, :] * k_prev
        v = f_v[None, :, None, :] * records[first][1] + c_v[None, :, None, :] * v_prev
        carry[attn.layer.k_sources] = fused[attn.layer.index] = (k, v)
    return fused


def _recorded(seed: int, batch: int, length: int):
    """The iterative model, random float64 K/V records of its storage layers, and what the recurrence carries."""
    model = _iterative_model()
    c = model.config
    g = torch.Generator().manual_seed(seed)
    shape = (batch, c.num_key_value_heads, length, c.head_dim)
    records = {i: (torch.randn(shape, generator=g, dtype=torch.float64),
                   torch.randn(shape, generator=g, dtype=torch.float64)) for i in c.plan.storage_layers}
    return model, records, _carried(model, records)


def test_unrolled_iterative_weights_equal_the_carried_recurrence():
    model, records, carried = _recorded(seed=1, batch=2, length=5)
    depths = []
    for layer in model.model.layers:
        attn = layer.self_attn
        if attn.layer.stores:
            continue
        src = attn.fusion.sources(records)
        assert len(src.keys) == len(src.values) == 2 and None not in (*src.key_weights, *src.value_weights)
        k, v = fuse_sources(src.keys, src.key_weights), fuse_sources(src.values, src.value_weights)
        torch.testing.assert_close(k, carried[attn.layer.index][0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(v, carried[attn.layer.index][1], rtol=1e-12, atol=1e-12)
        depths.append(len(attn.fusion.chain))
    assert depths[0] == 0 and max(depths) == 1  # the first step starts the chain, each later one links back
    # Differentiable: the gradients reaching every step's (f, c) are those of the carried recurrence.
    params = [p for n, p in model.named_parameters() if "fusion" in n]
    last = max(carried)
    target = sum(t.sum() * (i + 1) for i, t in enumerate(carried[last]))
    expected = torch.autograd.grad(target, params, allow_unused=True)
    src = model.model.layers[last].self_attn.fusion.sources(records)
    got_target = sum(fuse_sources(s, w).sum() * (i + 1)
                     for i, (s, w) in enumerate(((src.keys, src.key_weights), (src.values, src.value_weights))))
    got = torch.autograd.grad(got_target, params, allow_unused=True)
    for a, b in zip(got, expected):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_the_full_forward_equals_the_carried_recurrence_layer_by_layer():
    # The model's own forward (KVState records of the storage layers) fuses what the carry gives.
    model = _iterative_model()
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    seen = {}

    def record(module, args, output):
        seen[module.layer.index] = args[-1]  # the KVState

    hooks = [layer.self_attn.register_forward_hook(record) for layer in model.model.layers]
    with torch.no_grad():
        model(ids, use_cache=False)
    for h in hooks:
        h.remove()
    kv: KVState = next(iter(seen.values()))
    carried = _carried(model, kv.layers)
    for index, (k, v) in carried.items():
        src = model.model.layers[index].self_attn.fusion.sources(kv.layers)
        torch.testing.assert_close(fuse_sources(src.keys, src.key_weights), k, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(fuse_sources(src.values, src.value_weights), v, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("path", ["auto", "materialized", "factored"])
def test_unrolled_iterative_model_decodes_like_its_full_forward(path, decode_kernels):
    model = tiny_model("fusedkv-iterative", num_hidden_layers=6)
    randomize_fusion(model)
    select_runtime(model, path)
    ids, mask, width = padded_batch(7)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        steps, _ = incremental_logits(model, ids, mask, width)
    for k, step in enumerate(steps[1:]):
        assert (step[:, 0] - full[:, width + k]).abs().max() < 1e-4


def test_frozen_fusion_as_served_equals_the_carried_recurrence():
    """What a served layer takes (`KVFusion.frozen`, put on other tensors with `on`, a tensor-parallel rank's
    heads with `kv_heads`) fuses exactly as the carried recurrence: one implementation of the fusion."""
    model, records, carried = _recorded(seed=2, batch=1, length=4)
    heads = slice(1, 2)  # one rank's KV head of two
    for layer in model.model.layers:
        attn = layer.self_attn
        if attn.layer.stores:
            continue
        frozen = attn.fusion.frozen()
        assert not frozen.keys and all(not w.requires_grad for w in frozen.key_weights + frozen.value_weights)
        src = frozen.on([records[s][0] for s in attn.layer.k_sources], [records[s][1] for s in attn.layer.v_sources])
        k, v = fuse_sources(src.keys, src.key_weights), fuse_sources(src.values, src.value_weights)
        torch.testing.assert_close(k, carried[attn.layer.index][0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(v, carried[attn.layer.index][1], rtol=1e-12, atol=1e-12)
        rank = src.kv_heads(heads)
        torch.testing.assert_close(fuse_sources(rank.values, rank.value_weights),
                                   carried[attn.layer.index][1][:, heads], rtol=1e-12, atol=1e-12)
        with pytest.raises(ValueError, match="sources"):
            frozen.on([records[attn.layer.k_sources[0]][0]], [])


def test_distinct_and_scaled_sources_fuse_as_the_plain_sum():
    """A source named twice is read once with its weights summed (`distinct`); an 8-bit cache's scale folded into
    the weight (`scaled`) gives the fusion of the dequantised values."""
    from fusedkv.model.fusion import KVSources

    g = torch.Generator().manual_seed(3)
    x, y = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(2))
    w = [torch.rand(2, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    named = KVSources((), (w[0], None, w[1]), (), (w[2],))
    merged, k_ids, v_ids = named.distinct(["a", "b", "a"], ["b"])
    assert (k_ids, v_ids) == (("a", "b"), ("b",))
    want = fuse_sources([x, y, x], [w[0], None, w[1]])
    torch.testing.assert_close(fuse_sources([x, y], list(merged.key_weights)), want, rtol=1e-6, atol=1e-6)
    plain = KVSources((x, y), (w[0], None), (y,), (w[2],))
    codes = plain.on([x / 0.25, y / 4.0], [y / 0.5]).scaled([0.25, 4.0], [0.5], (2, 4))
    torch.testing.assert_close(fuse_sources(list(codes.keys), list(codes.key_weights)),
                               fuse_sources([x, y], [w[0], None]), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fuse_sources(list(codes.values), list(codes.value_weights)), fuse_sources([y], [w[2]]),
                               rtol=1e-6, atol=1e-6, check_dtype=False)
