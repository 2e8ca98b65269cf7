"""The closed-form fits of calibrated conversion on tensors built as exact fusions: recovered to float64
precision, RoPE pairs tied, the right sources chosen, a linear layer refitted exactly."""

from __future__ import annotations

import pytest
import torch

from fusedkv.calibrate import FusionStats, RidgeStats, fusion_parameter

H, D = 3, 8


def _kv(gen, n: int, batch: int = 2, tokens: int = 40) -> list[torch.Tensor]:
    return [torch.randn(batch, H, tokens, D, generator=gen, dtype=torch.float64) for _ in range(n)]


def _fused(sources, weights):
    return sum(w[None, :, None, :] * s for w, s in zip(weights, sources))


def test_tied_key_fusion_is_recovered_exactly():
    gen = torch.Generator().manual_seed(0)
    sources = _kv(gen, 2)
    half = torch.randn(2, H, D // 2, generator=gen, dtype=torch.float64)
    tied = torch.cat((half, half), dim=-1)  # the model's expansion of a tied key parameter
    stats = FusionStats((0, 5), "pair")
    for b in range(2):  # two batches: the statistics accumulate
        stats.add(_fused([s[b: b + 1] for s in sources], tied)[:, :, :, :], [s[b: b + 1] for s in sources])
    w, residual = stats.solve((0, 5))
    assert fusion_parameter(w, "pair", half.shape) == pytest.approx(half, abs=1e-12)
    assert float(residual.sum()) < 1e-12 * float(stats.energy.sum())


def test_untied_keys_are_fitted_by_pairs_not_channels():
    """A target whose best per-channel weights differ between the two halves of a rotation pair: the tied fit
    is one weight per pair (the least-squares solution over both coordinates), never two."""
    gen = torch.Generator().manual_seed(1)
    (x,) = _kv(gen, 1)
    untied = torch.rand(1, H, D, generator=gen, dtype=torch.float64) + 0.5
    y = _fused([x], untied)
    stats = FusionStats((2,), "pair")
    stats.add(y, [x])
    w = fusion_parameter(stats.solve((2,))[0], "pair", (1, H, D // 2))
    xs = torch.cat((x[..., : D // 2], x[..., D // 2:]), dim=2)  # both coordinates of each pair as samples
    ys = torch.cat((y[..., : D // 2], y[..., D // 2:]), dim=2)
    want = (xs * ys).sum(dim=(0, 2)) / (xs * xs).sum(dim=(0, 2))
    assert w[0] == pytest.approx(want, abs=1e-12)
    assert float(stats.solve((2,))[1].sum()) > 0  # the untied target cannot be met by tied weights


def test_value_and_scalar_fusion_recovered_exactly():
    gen = torch.Generator().manual_seed(2)
    sources = _kv(gen, 3)
    weights = torch.randn(3, H, D, generator=gen, dtype=torch.float64)
    stats = FusionStats((0, 1, 2), "channel")
    stats.add(_fused(sources, weights), sources)
    assert fusion_parameter(stats.solve((0, 1, 2))[0], "channel", weights.shape) == pytest.approx(weights, abs=1e-12)
    scalars = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64)
    stats = FusionStats((0, 1, 2), "scalar")
    stats.add(sum(a * s for a, s in zip(scalars, sources)), sources)
    assert fusion_parameter(stats.solve((0, 1, 2))[0], "scalar", (3,)) == pytest.approx(scalars, abs=1e-12)


def test_choose_finds_the_sources_of_an_exact_fusion():
    gen = torch.Generator().manual_seed(3)
    sources = _kv(gen, 5)
    weights = torch.randn(2, H, D // 2, generator=gen, dtype=torch.float64)
    target = _fused([sources[1], sources[3]], torch.cat((weights, weights), dim=-1))
    stats = FusionStats((0, 1, 2, 3, 4), "pair")
    stats.add(target, sources)
    chosen, residual = stats.choose(2)
    assert chosen == (1, 3) and residual < 1e-12 * float(stats.energy.sum())
    reuse = FusionStats((0, 1, 2), "channel")
    reuse.add(sources[2] + 0.01 * sources[0], sources[:3])
    assert reuse.choose(1, reuse=True)[0] == (2,)


def test_singular_sources_take_the_minimum_norm_fit():
    gen = torch.Generator().manual_seed(4)
    (x,) = _kv(gen, 1)
    stats = FusionStats((0, 1), "channel")
    stats.add(2 * x, [x, x])  # two identical sources: any a1 + a2 = 2 fits; min-norm gives 1 and 1
    w, residual = stats.solve((0, 1))
    assert w == pytest.approx(torch.ones_like(w), abs=1e-9)
    assert float(residual.sum()) < 1e-12 * float(stats.energy.sum())


def test_ridge_refit_recovers_a_linear_map_and_lowers_the_error():
    gen = torch.Generator().manual_seed(5)
    true = torch.randn(6, 10, generator=gen, dtype=torch.float64)
    start = torch.zeros(6, 10, dtype=torch.float64)
    stats = RidgeStats(10, 6)
    for _ in range(3):
        x = torch.randn(50, 10, generator=gen, dtype=torch.float64)
        stats.add(x, x @ true.T)
    assert stats.solve(start, ridge=0.0) == pytest.approx(true, abs=1e-10)
    assert stats.error(start) == pytest.approx(1.0)
    shrunk = stats.solve(start, ridge=0.1)  # pulled towards the start, still far better than it
    assert 0 < stats.error(shrunk) < 0.1
