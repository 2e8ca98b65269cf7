"""Learned cross-layer fusion weights of one reconstruction layer (paper Sec. 2.2-2.4, Eqs. 4-8; App. A.3).

    K^i = sum_s a_{i,s} (.) K^s        V^i = sum_s b_{i,s} (.) V^s

`a` and `b` are per-(kv head, channel) vectors ("channel" mode) or one scalar per source ("scalar"
mode, the dense-fusion exploration of Fig. 2); a "reuse" side has no weights at all.

Key weights are tied across each RoPE rotation pair: the fusion acts on post-RoPE keys, and only
equal weights on both coordinates of a rotation commute with it, leaving attention scores a function
of relative position (paper Sec. 2.4, Eqs. 7-8, App. A.4). With the rotate-half layout, channel j pairs with j + D/2, so
the key parameter stores D/2 values per head and is expanded as [w, w]. The tie is therefore
structural: training cannot break it.

Initialisation (paper App. A.3, Table 5):
  * "iterative": layer i fuses the previous reconstruction layer's K (a carry, starting at the
    second source K^n) with the fixed first source K^1: K^i = c_i (.) K^{i-1} + f_i (.) K^1.
    Weights start at (f, c) = `fusion_iterative_init`. The recurrence is linear, so it is never run as
    a carry: each layer's weights are unrolled into two-source coefficients on (K^1, K^n),
    A_i = c_i (.) A_{i-1} + f_i and B_i = c_i (.) B_{i-1} (A_0 = 0, B_0 = 1), from the chain's parameters
    on every call (differentiable, so training uses the same form), and the layer attends like any other.
  * "equivalent": the same recurrence unrolled into two-source coefficients, so the untrained model
    equals the iterative one; afterwards every layer's weights train freely.
  * "normal": drawn like every other weight, N(0, initializer_range).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import initialization as hf_init

from ..plan import LayerKV


@dataclass(frozen=True, slots=True)
class KVSources:
    """What one attention layer attends over, the one value every attention implementation takes:

        K = sum_s key_weights[s] (.) keys[s]        V = sum_s value_weights[s] (.) values[s]

    `keys` / `values`: [B, H_kv, S, D] (a storage layer's own cache, or its sources' post-RoPE K/V);
    weights: [H_kv, D] each, or None for plain reuse (weight 1). Built once per layer and forward by
    the layer (`KVFusion.sources`), already in this form: implementations do not re-normalise it."""

    keys: tuple[torch.Tensor, ...]
    key_weights: tuple[torch.Tensor | None, ...]
    values: tuple[torch.Tensor, ...]
    value_weights: tuple[torch.Tensor | None, ...]

    @classmethod
    def own(cls, k: torch.Tensor, v: torch.Tensor) -> KVSources:
        """A storage layer's sources: its own K and V, unweighted."""
        return cls((k,), (None,), (v,), (None,))


class KVFusion(nn.Module):
    # Where a source layer's keys and values sit in its (key, value) record of `KVState.layers`.
    KEY_SLOT, VALUE_SLOT = 0, 1

    def __init__(self, layer: LayerKV, num_kv_heads: int, head_dim: int, tie_rope_pairs: bool = True):
        super().__init__()
        self.layer = layer
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.tie_rope_pairs = tie_rope_pairs
        self.k_weight = self._make(layer.weight_shape("k", num_kv_heads, head_dim // 2 if tie_rope_pairs else head_dim))
        self.v_weight = self._make(layer.weight_shape("v", num_kv_heads, head_dim))
        self.chain: tuple[KVFusion, ...] | None = None  # the iterative variant: set by `link_iterative`

    def link_iterative(self, previous: KVFusion | None) -> None:
        """Make this layer a step of the iterative recurrence after `previous` (None: the first step). A tuple
        holds the reference, so the previous layer's module is not registered twice."""
        self.chain = () if previous is None else (previous,)

    def sources(self, layers: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> KVSources:
        """The layer's `KVSources` from the storage layers' (key, value) records of this forward."""
        keys = tuple(layers[s][self.KEY_SLOT] for s in self.layer.k_sources)
        values = tuple(layers[s][self.VALUE_SLOT] for s in self.layer.v_sources)
        key_weights, value_weights = self.weights()
        return KVSources(keys, key_weights, values, value_weights)

    def weights(self) -> tuple[tuple[torch.Tensor | None, ...], tuple[torch.Tensor | None, ...]]:
        """(key weights, value weights), one per source, as every attention implementation takes them (the
        iterative recurrence unrolled)."""
        if self.chain is not None:
            return self._unrolled()
        return tuple(self.key_weights()), tuple(self.value_weights())

    def _unrolled(self) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """The iterative recurrence as two-source weights on (K^1, K^n) and (V^1, V^n): this step's
        (fixed f_i, carry c_i) applied to the previous step's coefficients, A_i = c_i A_{i-1} + f_i,
        B_i = c_i B_{i-1}, starting from the carry K^n itself (A_0 = 0, B_0 = 1)."""
        (f_k, c_k), (f_v, c_v) = self.key_weights(), self.value_weights()
        if not self.chain:
            return (f_k, c_k), (f_v, c_v)
        (a_k, b_k), (a_v, b_v) = self.chain[0]._unrolled()
        return (c_k * a_k + f_k, c_k * b_k), (c_v * a_v + f_v, c_v * b_v)

    @staticmethod
    def _make(shape: tuple[int, ...] | None) -> nn.Parameter | None:
        return None if shape is None else nn.Parameter(torch.ones(shape))

    # ---- the weights the attention kernels take: one [H_kv, D] tensor (or None) per source -------
    def key_weights(self) -> list[torch.Tensor | None]:
        w = self.k_weight
        if w is None:
            return [None]
        if w.dim() == 1:
            return [x.expand(self.num_kv_heads, self.head_dim) for x in w]
        if self.tie_rope_pairs:
            w = torch.cat((w, w), dim=-1)
        return list(w.unbind(0))

    def value_weights(self) -> list[torch.Tensor | None]:
        w = self.v_weight
        if w is None:
            return [None]
        if w.dim() == 1:
            return [x.expand(self.num_kv_heads, self.head_dim) for x in w]
        return list(w.unbind(0))

    # ---- initialisation ---------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self, init: str, depth: int, iterative_init: tuple[float, float], std: float) -> None:
        """`depth`: this layer's step in the iterative recurrence (1 for the first reconstruction layer).

        Uses transformers' guarded init functions, so weights loaded from a checkpoint are never
        overwritten by `from_pretrained`'s initialisation of missing weights."""
        carry, fixed = iterative_init
        for w in (self.k_weight, self.v_weight):
            if w is None:
                continue
            if init == "normal":
                hf_init.normal_(w, mean=0.0, std=std)
                continue
            if w.shape[0] == 2 and init == "iterative":
                coeffs = (fixed, carry)  # on K^1 (fixed source), on the carried K^{i-1}
            elif w.shape[0] == 2:  # equivalent: unroll to  f * sum_{j<d} c^j K^1 + c^d K^n
                coeffs = (fixed * sum(carry**j for j in range(depth)), carry**depth)
            else:
                # Single-source scaling starts as plain reuse; many sources start as their average.
                coeffs = (1.0 / w.shape[0],) * w.shape[0]
            value = torch.tensor(coeffs, dtype=w.dtype, device=w.device).view(-1, *([1] * (w.dim() - 1)))
            hf_init.copy_(w, value.expand_as(w))
