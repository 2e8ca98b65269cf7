"""Wanda pruning: exact sparsity, calibration statistics against a direct computation (including the
layer-by-layer recomputation through pruned layers), N:M patterns, the command's checkpoint."""

import pytest
import torch
import torch.nn.functional as F

from fusedkv.prune.wanda import (
    block_linears,
    calibration_batches,
    input_square_norms,
    parse_nm,
    prune_mask,
    wanda_prune,
    wanda_scores,
)
from tests.conftest import tiny_model


def _calibration(seed=0, n=6, t=24):
    g = torch.Generator().manual_seed(seed)
    return list(torch.randint(1, 97, (n, t), generator=g).split(4))


def _direct_norms(model, layer_idx, calibration):
    """sum x_j^2 of each linear's input, computed from hidden states without hooks."""
    layer = model.model.layers[layer_idx]
    out = {}
    with torch.no_grad():
        for ids in calibration:
            hidden = model(ids, output_hidden_states=True, use_cache=False).hidden_states[layer_idx]
            x = layer.input_layernorm(hidden)
            inputs = {"self_attn.q_proj": x, "self_attn.k_proj": x, "self_attn.v_proj": x}
            h = hidden + layer.self_attn(x, *_rope(model, ids), None, _kv_state(model, ids, layer_idx))
            attn_in = _attention_output_input(model, ids, layer_idx)
            inputs["self_attn.o_proj"] = attn_in
            y = layer.post_attention_layernorm(h)
            inputs["mlp.gate_proj"] = inputs["mlp.up_proj"] = y
            inputs["mlp.down_proj"] = F.silu(layer.mlp.gate_proj(y)) * layer.mlp.up_proj(y)
            for name, x_in in inputs.items():
                if name in block_linears(layer):
                    out[name] = out.get(name, 0) + x_in.double().pow(2).sum((0, 1))
    return out


def _rope(model, ids):
    from fusedkv.model.layers import rope_cos_sin

    pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    return rope_cos_sin(pos, model.config.head_dim, model.config.rope_theta, torch.float32)


def _kv_state(model, ids, layer_idx):
    """The K/V of the storage layers below `layer_idx`, as the model's own forward leaves them."""
    from fusedkv.model.attention import KVState

    kv = KVState(causal=True)
    x = model.model.embed_tokens(ids)
    cos, sin = _rope(model, ids)
    for layer in model.model.layers[:layer_idx]:
        x = layer(x, cos, sin, None, kv)
    return kv


def _attention_output_input(model, ids, layer_idx):
    captured = {}
    o_proj = model.model.layers[layer_idx].self_attn.o_proj
    handle = o_proj.register_forward_pre_hook(lambda m, a: captured.setdefault("x", a[0]))
    try:
        model(ids, use_cache=False)
    finally:
        handle.remove()
    return captured["x"]


@pytest.mark.parametrize("plan", ["vanilla", "fusedkv"])
def test_calibration_statistics_match_a_direct_computation_through_pruned_layers(plan):
    model = tiny_model(plan)
    calib = _calibration()
    for layer_idx in range(len(model.model.layers)):
        hooked = input_square_norms(model, layer_idx, calib)
        direct = _direct_norms(model, layer_idx, calib)
        assert set(hooked) == set(direct) == set(block_linears(model.model.layers[layer_idx]))
        for name in hooked:
            torch.testing.assert_close(hooked[name], direct[name], rtol=1e-5, atol=1e-6)
        # prune this layer, so the next one is measured through it (as wanda_prune does)
        for name, lin in block_linears(model.model.layers[layer_idx]).items():
            with torch.no_grad():
                lin.weight.masked_fill_(prune_mask(wanda_scores(lin.weight, hooked[name]), 0.5), 0)
    # and the statistics of the top layer really depend on the pruning below
    fresh = tiny_model(plan)
    top = len(model.model.layers) - 1
    before = input_square_norms(fresh, top, calib)["self_attn.q_proj"]
    after = input_square_norms(model, top, calib)["self_attn.q_proj"]
    assert not torch.allclose(before, after, rtol=1e-3)


def test_scores_and_mask_keep_the_highest_scores_of_each_row():
    w = torch.randn(6, 16)
    norms = torch.rand(16) * 4
    scores = wanda_scores(w, norms)
    torch.testing.assert_close(scores, w.abs().double() * norms.double().sqrt())
    mask = prune_mask(scores, 0.5)
    for row in range(6):
        kept = scores[row][~mask[row]]
        dropped = scores[row][mask[row]]
        assert kept.numel() == dropped.numel() == 8 and kept.min() >= dropped.max()


@pytest.mark.parametrize("sparsity", [0.5, 0.25, 0.75])
def test_pruning_leaves_exactly_the_requested_sparsity(sparsity):
    model = tiny_model("fusedkv")
    report = wanda_prune(model, _calibration(), sparsity=sparsity)
    names = {r.name for r in report}
    for idx, layer in enumerate(model.model.layers):
        for name, lin in block_linears(layer).items():
            assert f"model.layers.{idx}.{name}.weight" in names
            zeros_per_row = (lin.weight == 0).sum(1)
            assert bool((zeros_per_row == int(lin.in_features * sparsity)).all())
    assert all(r.sparsity == sparsity for r in report)
    # storage layers have k/v projections, reconstruction layers do not
    assert "model.layers.0.self_attn.k_proj.weight" in names
    assert "model.layers.3.self_attn.k_proj.weight" not in names
    assert model.model.embed_tokens.weight.ne(0).all() and model.lm_head.weight.ne(0).all()


def test_n_m_pattern_holds():
    model = tiny_model("fusedkv")
    report = wanda_prune(model, _calibration(), sparsity=None, nm=(2, 4))
    for layer in model.model.layers:
        for lin in block_linears(layer).values():
            groups = (lin.weight == 0).reshape(lin.out_features, -1, 4).sum(-1)
            assert bool((groups == 2).all())
    assert all(r.sparsity == 0.5 for r in report)


def test_bad_settings_are_one_line_errors():
    with pytest.raises(ValueError, match="N:M"):
        parse_nm("2-4")
    with pytest.raises(ValueError, match="0 < N < M"):
        parse_nm("4:2")
    model = tiny_model("fusedkv")
    with pytest.raises(ValueError, match="contradicts"):
        wanda_prune(model, _calibration(), sparsity=0.3, nm=(2, 4))
    with pytest.raises(ValueError, match="in \\[0, 1\\)"):
        wanda_prune(model, _calibration(), sparsity=1.5)
    with pytest.raises(ValueError, match="multiple of M=3"):
        prune_mask(torch.rand(2, 16), nm=(1, 3))
    with pytest.raises(ValueError, match="fewer than --calib-len"):
        calibration_batches(list(range(10)), 2, 16)


def test_calibration_windows_are_random_slices_of_the_text():
    import numpy as np

    tokens = np.arange(1000, dtype=np.uint16)
    batches = calibration_batches(tokens, 5, 32, batch_size=2, seed=1)
    windows = torch.cat(batches)
    assert [b.shape[0] for b in batches] == [2, 2, 1] and windows.shape == (5, 32)
    assert bool((windows[:, 1:] - windows[:, :-1] == 1).all())  # contiguous slices
    assert len(set(windows[:, 0].tolist())) == 5
