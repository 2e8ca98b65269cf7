"""The analyses: dense-fusion coefficient matrices and heat maps, gradient-norm recording and plots."""

import math

import torch

from fusedkv.analysis import dense_coefficients, plot_dense_heatmaps, plot_gradient_norms, record_gradient_norms
from tests.conftest import tiny_model


def test_dense_coefficients_read_the_learned_scalars(tmp_path):
    model = tiny_model("fusedkv-dense", num_hidden_layers=6)
    k, v, targets, sources = dense_coefficients(model)
    assert targets == [4, 5, 6] and sources == [1, 2, 3]
    fusion = model.model.layers[4].self_attn.fusion
    assert torch.equal(k[1], fusion.k_weight.detach()) and torch.equal(v[1], fusion.v_weight.detach())
    png = plot_dense_heatmaps(model, tmp_path / "dense.png")
    assert (tmp_path / "dense.png").stat().st_size > 10_000 and png.endswith(".png")


def test_dense_coefficients_refuse_a_model_without_scalar_fusion():
    import pytest

    with pytest.raises(ValueError, match="fusedkv-dense"):
        dense_coefficients(tiny_model("fusedkv"))


def test_gradient_norms_per_layer(tmp_path):
    model = tiny_model("fusedkv")
    g = torch.Generator().manual_seed(0)
    batches = ((x[:, :-1], x[:, 1:]) for x in (torch.randint(1, 97, (2, 17), generator=g) for _ in range(3)))
    norms = record_gradient_norms(model, batches, steps=3)
    assert len(norms["q"]) == 3 and len(norms["q"][0]) == 4
    assert all(x > 0 for x in norms["q"][0])
    assert norms["k"][0][0] > 0 and math.isnan(norms["k"][0][3])  # upper layers have no k_proj
    plot_gradient_norms(norms, tmp_path / "g.png")
    assert (tmp_path / "g.png").stat().st_size > 10_000
