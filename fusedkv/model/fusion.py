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

from collections.abc import Hashable, Iterable, Sequence
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
    the layer (`KVFusion.sources`), already in this form: implementations do not re-normalise it. A served
    layer takes its fusion frozen once (`KVFusion.frozen`) and puts it on each step's paged caches (`on`)."""

    keys: tuple[torch.Tensor, ...]
    key_weights: tuple[torch.Tensor | None, ...]
    values: tuple[torch.Tensor, ...]
    value_weights: tuple[torch.Tensor | None, ...]

    @classmethod
    def own(cls, k: torch.Tensor, v: torch.Tensor) -> KVSources:
        """A storage layer's sources: its own K and V, unweighted."""
        return cls((k,), (None,), (v,), (None,))

    # ---- one fusion over other tensors: serving's paged caches (the weights are fixed once loaded) ----------
    def on(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> KVSources:
        """The same weights over other tensors of the same sources (serving: one step's views of the source
        layers' paged caches, or rows gathered from them), one per weight, in order."""
        if len(keys) != len(self.key_weights) or len(values) != len(self.value_weights):
            raise ValueError(f"{len(keys)} keys and {len(values)} values for a fusion of {len(self.key_weights)} "
                             f"and {len(self.value_weights)} sources")
        return KVSources(tuple(keys), self.key_weights, tuple(values), self.value_weights)

    def kv_heads(self, heads: slice) -> KVSources:
        """Restricted to the KV heads `heads` (tensor parallel: one rank's heads; the fusion is per KV head, Eq.
        4-5): the weights' rows and the tensors' head dimension (dim 1)."""
        def rows(ws):
            return tuple(None if w is None else w[heads] for w in ws)

        return KVSources(tuple(x[:, heads] for x in self.keys), rows(self.key_weights),
                         tuple(x[:, heads] for x in self.values), rows(self.value_weights))

    def scaled(self, key_scales: Sequence[float], value_scales: Sequence[float], shape: tuple[int, int]) -> KVSources:
        """Each source's dequantisation scale folded into its weight ([H_kv, D] = `shape` where it had none): an
        8-bit cache holds x / scale, and w (.) x = (w * scale) (.) code since Eq. 4-5 are linear in the sources.
        A scale of 1 leaves the weight as it is."""
        def fold(ws, scales):
            return tuple(w if scale == 1.0 else w.float() * scale if w is not None
                         else torch.full(shape, float(scale), device=self._device()) for w, scale in zip(ws, scales))

        return KVSources(self.keys, fold(self.key_weights, key_scales), self.values,
                         fold(self.value_weights, value_scales))

    def distinct(self, key_ids: Sequence[Hashable],
                 value_ids: Sequence[Hashable]) -> tuple[KVSources, tuple[Hashable, ...], tuple[Hashable, ...]]:
        """Sources named twice (`key_ids` / `value_ids`: which source each entry is) merged into one entry,
        a (.) X + b (.) X = (a + b) (.) X: (the merged value over no tensors, the distinct key ids, value ids).
        A kernel then reads each source once."""
        def merge(ws, ids):
            out: dict[Hashable, torch.Tensor | None] = {}
            for w, i in zip(ws, ids):
                if i not in out:
                    out[i] = w
                    continue
                one = torch.ones(self._shape(), device=self._device())
                prev = one if out[i] is None else out[i].float()
                out[i] = prev + (one if w is None else w.float())
            return tuple(out.values()), tuple(out)

        kw, k_ids = merge(self.key_weights, key_ids)
        vw, v_ids = merge(self.value_weights, value_ids)
        return KVSources((), kw, (), vw), k_ids, v_ids

    def _device(self) -> torch.device:
        """Where new weights go: with the tensors, else with the other weights."""
        found = (*self.keys, *(w for w in (*self.key_weights, *self.value_weights) if w is not None))
        return found[0].device if found else torch.device("cpu")

    def _shape(self) -> tuple[int, ...]:
        w = next((w for w in (*self.key_weights, *self.value_weights) if w is not None), None)
        if w is None:
            raise ValueError("a source named twice without weights has no [H_kv, D] shape to merge into")
        return tuple(w.shape)


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

    @torch.no_grad()
    def frozen(self) -> KVSources:
        """This layer's fusion as fixed weights over no tensors yet (`KVSources.on` puts them on some): what a
        served layer takes once its checkpoint has loaded (the iterative chain unrolled, as `weights`)."""
        key_weights, value_weights = self.weights()
        fixed = lambda ws: tuple(None if w is None else w.detach().contiguous() for w in ws)  # noqa: E731
        return KVSources((), fixed(key_weights), (), fixed(value_weights))

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


def link_iterative_chains(fusions: Iterable[KVFusion], init: str) -> None:
    """With the iterative variant (`init`, paper App. A.3), make each layer's fusion (in layer order) continue
    the recurrence of the previous one reading the same sources; its `weights` then unroll the chain. Any
    other initialisation leaves the layers independent."""
    if init != "iterative":
        return
    previous: dict[tuple[int, ...], KVFusion] = {}
    for fusion in fusions:
        fusion.link_iterative(previous.get(fusion.layer.k_sources))
        previous[fusion.layer.k_sources] = fusion
