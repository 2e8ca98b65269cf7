"""The closed-form fits of calibrated conversion: fusion weights by least squares, source layers by residual,
and a linear layer by ridge least squares. Pure tensor arithmetic on float64 normal-equation statistics,
accumulated batch by batch (nothing here keeps activations).

Fusion (paper Eqs. 4-5): an upper layer's post-RoPE keys K^i are approximated channel by channel as
sum_s a_s (.) K^s over its source layers s. For each fitting *group* g the least-squares weights solve
G_g a = b_g with G_g = sum x x^T (over tokens, the group's channels) and b_g = sum x y. A group is

  * "pair":    a (KV head, RoPE rotation pair): channels j and j + D/2 share one weight, as the model ties
               key weights (`fusedkv.model.fusion`, paper Sec. 2.4), so both coordinates enter one system;
  * "channel": a (KV head, channel): values, and keys of a model that does not tie;
  * "scalar":  everything: one weight per source (the dense-fusion plan).

The statistics are kept over every *candidate* source (all storage layers below the layer that could feed
it), so any subset's fit is a sub-block solve, and the best subset (`choose`) costs no further pass.
The residual of a fit is sum y^2 - b^T a (the least-squares optimum), summed over groups.
"""

from __future__ import annotations

from itertools import combinations

import torch

from ..plan import CHANNEL, SCALAR

GROUPINGS = ("pair", CHANNEL, SCALAR)
# Combinations of candidate layers `choose` tries at most (C(30, 2) = 435 for a 60-layer model's pair).
MAX_SUBSETS = 20_000


def _grouped(x: torch.Tensor, grouping: str) -> torch.Tensor:
    """[B, H, T, D] -> [H', D', M] float64: the samples of each group along the last dimension."""
    x = x.to(torch.float64)
    b, h, t, d = x.shape
    if grouping == SCALAR:
        return x.reshape(1, 1, -1)
    x = x.permute(1, 3, 0, 2).reshape(h, d, b * t)  # [H, D, M]
    if grouping == "pair":  # channel j and j + D/2 are samples of one weight
        x = torch.cat((x[:, : d // 2], x[:, d // 2:]), dim=-1)
    return x


class FusionStats:
    """Normal-equation statistics of one side (K or V) of one reconstruction layer over C candidate sources:
    `gram` [H', D', C, C], `cross` [H', D', C], `energy` [H', D'] (sum y^2), all float64."""

    def __init__(self, candidates: tuple[int, ...], grouping: str):
        if grouping not in GROUPINGS:
            raise ValueError(f"grouping {grouping!r}: choose one of {GROUPINGS}")
        self.candidates, self.grouping = tuple(candidates), grouping
        self.gram = self.cross = self.energy = None
        self.samples = 0

    def add(self, target: torch.Tensor, sources: list[torch.Tensor]) -> None:
        """One batch: `target` [B, H, T, D] (the layer's own post-RoPE K or V), `sources` one tensor of that
        shape per candidate, in `candidates`' order."""
        if len(sources) != len(self.candidates):
            raise ValueError(f"{len(sources)} source tensors for {len(self.candidates)} candidates")
        y = _grouped(target, self.grouping)  # [H', D', M]
        x = torch.stack([_grouped(s, self.grouping) for s in sources], dim=-2)  # [H', D', C, M]
        gram, cross, energy = x @ x.transpose(-1, -2), (x @ y.unsqueeze(-1)).squeeze(-1), (y * y).sum(-1)
        if self.gram is None:
            self.gram, self.cross, self.energy = gram, cross, energy
        else:
            self.gram += gram
            self.cross += cross
            self.energy += energy
        self.samples += y.shape[-1]

    def _index(self, subset: tuple[int, ...]) -> torch.Tensor:
        missing = [s for s in subset if s not in self.candidates]
        if missing:
            raise ValueError(f"source layers {missing} are not among the candidates {self.candidates}")
        return torch.tensor([self.candidates.index(s) for s in subset])

    def solve(self, subset: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [H', D', len(subset)], residual energy [H', D']) of the least-squares fit on `subset`.
        A singular system (a source channel that is all zero, or two identical sources) takes the
        minimum-norm solution."""
        if self.gram is None:
            raise ValueError("no calibration data was added")
        idx = self._index(subset)
        g, b = self.gram[..., idx[:, None], idx], self.cross[..., idx]
        try:
            w = torch.linalg.solve(g, b)
            ok = bool(torch.isfinite(w).all())
        except RuntimeError:  # singular
            ok = False
        if not ok:
            w = (torch.linalg.pinv(g, hermitian=True) @ b.unsqueeze(-1)).squeeze(-1)
        residual = (self.energy - (w * b).sum(-1)).clamp_min(0.0)
        return w, residual

    def residual(self, subset: tuple[int, ...]) -> float:
        """Unexplained energy of the best fit on `subset`, summed over groups."""
        return float(self.solve(subset)[1].sum())

    def reuse_residual(self, source: int) -> float:
        """Unexplained energy when the source is taken as it is (weight 1, a reuse side)."""
        i = self.candidates.index(source)
        return float((self.energy - 2 * self.cross[..., i] + self.gram[..., i, i]).clamp_min(0.0).sum())

    def relative(self, residual: float) -> float:
        """`residual` as a share of the target's energy (1: nothing explained)."""
        return residual / max(float(self.energy.sum()), 1e-300)

    def choose(self, size: int, reuse: bool = False) -> tuple[tuple[int, ...], float]:
        """The `size` candidates (ascending) whose fit leaves the least residual, and that residual. `reuse`:
        one source taken as it is, with no weight (Lite, YOCO)."""
        if size > len(self.candidates):
            raise ValueError(f"{size} sources asked for, only {len(self.candidates)} candidates")
        subsets = list(combinations(self.candidates, size))
        if len(subsets) > MAX_SUBSETS:
            raise ValueError(f"{len(subsets)} source combinations to compare (over {MAX_SUBSETS}); give the plan's "
                             "sources instead of choosing them")
        score = (lambda s: self.reuse_residual(s[0])) if reuse else self.residual
        best = min(subsets, key=score)
        return best, score(best)


def fusion_parameter(weights: torch.Tensor, grouping: str, shape: torch.Size) -> torch.Tensor:
    """`solve`'s weights [H', D', S] as `KVFusion`'s parameter of `shape` ([S, H_kv, D or D/2], or [S])."""
    if grouping == SCALAR:
        return weights.reshape(-1).reshape(shape)
    return weights.permute(2, 0, 1).reshape(shape)


class RidgeStats:
    """Normal equations of a linear layer y = W x refitted by ridge least squares towards its present
    weights W0: minimise sum ||W x - y||^2 + lam ||W - W0||^2, lam = `ridge` * mean(diag(sum x x^T))."""

    def __init__(self, in_features: int, out_features: int):
        self.gram = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.cross = torch.zeros(in_features, out_features, dtype=torch.float64)
        self.energy = torch.zeros((), dtype=torch.float64)
        self.samples = 0

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """x [..., in], y [..., out]: a batch of the layer's inputs and the outputs it should give."""
        x = x.reshape(-1, x.shape[-1]).to(torch.float64)
        y = y.reshape(-1, y.shape[-1]).to(torch.float64)
        self.gram += x.T @ x
        self.cross += x.T @ y
        self.energy += (y * y).sum()
        self.samples += x.shape[0]

    def error(self, weight: torch.Tensor) -> float:
        """sum ||W x - y||^2 / sum ||y||^2 over the data added, for weight W [out, in]."""
        w = weight.to(torch.float64).T
        err = (w * (self.gram @ w)).sum() - 2 * (w * self.cross).sum() + self.energy
        return float(err.clamp_min(0.0) / self.energy.clamp_min(1e-300))

    def solve(self, weight0: torch.Tensor, ridge: float) -> torch.Tensor:
        """The refitted weight [out, in] (float64)."""
        n = self.gram.shape[0]
        lam = ridge * float(self.gram.diagonal().mean().clamp_min(1e-300))
        w0 = weight0.to(torch.float64).T
        w = torch.linalg.solve(self.gram + lam * torch.eye(n, dtype=torch.float64), self.cross + lam * w0)
        return w.T
