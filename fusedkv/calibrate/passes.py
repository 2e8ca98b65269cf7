"""The two passes of calibrated conversion over calibration text, with the original (vanilla) model as teacher.

1. `fit_fusion` (streamed): the teacher runs batch by batch; every upper layer's own post-RoPE K and V and
   the K/V of its candidate source layers feed `FusionStats`, and only those float64 statistics are kept.
   It returns each reconstruction layer's fusion weights (least squares, `fit.py`) and, when asked, its
   source layers (the subset with the least residual), before the converted model is even built.
2. `refit_layers` (layer by layer, as GPTQ / SparseGPT fit layers): teacher and converted model advance
   one layer at a time over all calibration sequences; at each reconstruction layer the output projection
   (stage "o_proj") and then the MLP's down projection ("mlp") are refitted by ridge least squares, each on
   the inputs the already-refitted layers below give the converted model, so that the residual stream after
   the layer matches the teacher's (the fit's target includes the drift the layers below left). Memory: the
   residual stream of every calibration token for both models plus the converted model's source K/V, never
   every layer's activations.

Only attention with K/V projections is calibrated (not MLA); layers with post-norms or a sparse MLP get the
o_proj fit against the teacher's attention output alone (their residual cannot be matched in closed form).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..model.attention import KVState
from ..model.modeling import _window_mask
from ..plan import CHANNEL, REUSE, SCALAR, SLIDING, KVSharingPlan
from .fit import FusionStats, RidgeStats, fusion_parameter

REFIT_STAGES = ("o_proj", "mlp")


@dataclass
class LayerFit:
    """One reconstruction layer's calibration: sources (0-based), fusion weights as `KVFusion` parameters
    (None: a reuse side) and the relative residuals / errors each stage measured on the calibration text."""

    index: int
    k_sources: tuple[int, ...]
    v_sources: tuple[int, ...]
    k_weight: torch.Tensor | None = None
    v_weight: torch.Tensor | None = None
    errors: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict:
        return {"layer": self.index + 1, "k_sources": [s + 1 for s in self.k_sources],
                "v_sources": [s + 1 for s in self.v_sources], **{k: round(v, 6) for k, v in self.errors.items()}}


def _grouping(mode: str, tied: bool, side: str) -> str:
    return SCALAR if mode == SCALAR else "pair" if side == "K" and tied else CHANNEL


@contextmanager
def _captured_kv(model):
    """The `KVState` of each forward of `model` (a FusedKVForCausalLM), caught as its first layer is called."""
    seen: list[KVState] = []
    handle = model.model.layers[0].register_forward_pre_hook(lambda mod, args: seen.append(args[4]))
    try:
        yield seen
    finally:
        handle.remove()


@torch.no_grad()
def fit_fusion(teacher, plan: KVSharingPlan, batches: list[torch.Tensor], choose_sources: bool = False,
               tie_rope_pairs: bool = True, progress=None) -> list[LayerFit]:
    """Pass 1: the fusion weights (and sources) of every reconstruction layer of `plan`, from the teacher's
    K/V on `batches` ([1, T] token ids each). Candidates for a chosen source: the storage layers below the
    layer, of its attention type; the number of sources and the fusion mode stay the plan's."""
    wanted = {}
    for layer in plan.layers:
        if layer.stores:
            continue
        sides = {}
        for side, srcs, mode in (("K", layer.k_sources, layer.k_fusion), ("V", layer.v_sources, layer.v_fusion)):
            cands = tuple(s for s in plan.storage_layers if s < layer.index
                          and plan.layers[s].attention_type == layer.attention_type) if choose_sources else srcs
            sides[side] = (FusionStats(cands, _grouping(mode, tie_rope_pairs, side)), len(srcs), mode)
        wanted[layer.index] = sides
    with _captured_kv(teacher) as seen:
        for ids in (progress(batches, "calibrate: fusion fit") if progress else batches):
            seen.clear()
            teacher.model(input_ids=ids, use_cache=False)
            layers = seen[0].layers
            for i, sides in wanted.items():
                for slot, side in enumerate("KV"):
                    stats = sides[side][0]
                    stats.add(layers[i][slot], [layers[c][slot] for c in stats.candidates])
    fits = []
    for i, sides in wanted.items():
        fit = LayerFit(i, (), ())
        for side in "KV":
            stats, size, mode = sides[side]
            reuse = mode == REUSE
            chosen = stats.choose(size, reuse=reuse)[0] if choose_sources else stats.candidates
            if reuse:
                residual, weight = stats.reuse_residual(chosen[0]), None
            else:
                w, res = stats.solve(chosen)
                residual, weight = float(res.sum()), w
            fit.errors[f"{side.lower()}_residual"] = stats.relative(residual)
            if side == "K":
                fit.k_sources, fit.k_weight = chosen, weight
            else:
                fit.v_sources, fit.v_weight = chosen, weight
        fits.append(fit)
    return fits


def source_map(plan: KVSharingPlan, fits: list[LayerFit]) -> list[dict]:
    """The fitted sources as a custom `kv_source_map` (1-based, one entry per reconstruction layer)."""
    return [{"layers": [f.index + 1, f.index + 1], "k": [s + 1 for s in f.k_sources],
             "v": [s + 1 for s in f.v_sources], "k_fusion": plan.layers[f.index].k_fusion,
             "v_fusion": plan.layers[f.index].v_fusion} for f in fits]


@torch.no_grad()
def set_fusion(model, fits: list[LayerFit]) -> None:
    """Write the fitted fusion weights into `model`'s reconstruction layers (whose sources must be the fits')."""
    for fit in fits:
        attn = model.model.layers[fit.index].self_attn
        if (attn.layer.k_sources, attn.layer.v_sources) != (fit.k_sources, fit.v_sources):
            raise ValueError(f"layer {fit.index + 1} reads other sources than were fitted")
        for param, weight, grouping in ((attn.fusion.k_weight, fit.k_weight, "K"),
                                        (attn.fusion.v_weight, fit.v_weight, "V")):
            if param is not None and weight is not None:
                param.copy_(fusion_parameter(weight, SCALAR if param.dim() == 1 else grouping, param.shape))


@contextmanager
def _inputs(module):
    """The input (first positional argument) of `module`'s next call, as `box[0]`."""
    box: list[torch.Tensor] = []
    handle = module.register_forward_pre_hook(lambda mod, args: box.append(args[0]))
    try:
        yield box
    finally:
        handle.remove()


def _simple(layer) -> bool:
    """A pre-norm layer with a dense MLP: its residual stream can be matched stage by stage."""
    return not getattr(layer, "post_norms", False) and not getattr(layer, "sparse", False)


def _embed(model, ids: torch.Tensor) -> torch.Tensor:
    """The residual stream entering layer 1 (as `FusedKVModel.forward` computes it)."""
    x = model.model.embed_tokens(ids)
    mult = model.config.embedding_multiplier
    return x * torch.tensor(float(mult)).to(x.dtype) if mult != 1.0 else x





@torch.no_grad()
def refit_layers(teacher, student, batches: list[torch.Tensor], fits: list[LayerFit], stages=REFIT_STAGES,
                 ridge: float = 1e-2, progress=None) -> None:
    """Pass 2 (module docstring): refit the `stages` of every reconstruction layer of `student` in layer order;
    each stage's relative error before and after lands in the layer's `LayerFit.errors`."""
    plan, cfg = student.plan, student.config
    by_index = {f.index: f for f in fits}
    read = {s for layer in plan.layers if not layer.stores for s in layer.sources}
    n = batches[0].shape[1]
    positions = torch.arange(n).unsqueeze(0)
    window = None
    if cfg.sliding_window and SLIDING in (cfg.layer_types or ()):
        window = _window_mask(None, True, 0, n, cfg.sliding_window, positions.device)
    x_t = [_embed(teacher, ids) for ids in batches]
    x_s = list(x_t)
    rope = teacher.model._rope_tables(positions, x_t[0].dtype)
    kv_t = [KVState(causal=True, window_mask=window) for _ in batches]
    kv_s = [KVState(causal=True, window_mask=window) for _ in batches]
    same = True  # until the first reconstruction layer, the converted model computes what the teacher does
    layers = range(plan.num_layers)
    for i in (progress(layers, "calibrate: layer refit") if progress else layers):
        t_layer, s_layer, lkv = teacher.model.layers[i], student.model.layers[i], plan.layers[i]
        cos, sin = rope[teacher.model.rope_keys[i]]
        if lkv.stores:
            for b in range(len(batches)):
                out = t_layer(x_t[b], cos, sin, None, kv_t[b])
                if same:
                    x_s[b] = out
                    kv_s[b].layers[i] = kv_t[b].layers[i]
                else:
                    x_s[b] = s_layer(x_s[b], cos, sin, None, kv_s[b])
                x_t[b] = out
                kv_t[b].layers.pop(i)  # the teacher's K/V serve only its own layer
                if i not in read:
                    kv_s[b].layers.pop(i, None)
            continue
        same = False
        _refit_layer(t_layer, s_layer, (cos, sin), x_t, x_s, kv_t, kv_s, stages, ridge, by_index[i].errors)


def _refit_layer(t_layer, s_layer, rope, x_t, x_s, kv_t, kv_s, stages, ridge: float, errors: dict) -> None:
    """Refit one reconstruction layer's `stages` and advance both residual streams past it (in place)."""
    cos, sin = rope
    simple = _simple(s_layer)
    o_proj = s_layer.self_attn.o_proj
    o_stats = RidgeStats(o_proj.in_features, o_proj.out_features)
    t_next, s_feats = [], []
    for b in range(len(x_t)):
        y_t = t_layer.self_attn(t_layer.input_layernorm(x_t[b]), cos, sin, None, kv_t[b])
        kv_t[b].layers.clear()
        if simple:
            mid = x_t[b] + y_t
            t_next.append(mid + t_layer.mlp(t_layer.post_attention_layernorm(mid)))
        else:
            t_next.append(t_layer(x_t[b], cos, sin, None, kv_t[b]))
            kv_t[b].layers.clear()
        with _inputs(o_proj) as a:
            s_layer.self_attn(s_layer.input_layernorm(x_s[b]), cos, sin, None, kv_s[b])
        # Simple layers: the attention output that puts the residual stream back on the teacher's.
        target = y_t + (x_t[b] - x_s[b]) if simple else y_t
        o_stats.add(a[0], target - (o_proj.bias if o_proj.bias is not None else 0.0))
        s_feats.append(a[0])
    errors["o_proj_before"] = o_stats.error(o_proj.weight)
    if "o_proj" in stages:
        o_proj.weight.copy_(o_stats.solve(o_proj.weight, ridge).to(o_proj.weight.dtype))
        errors["o_proj_after"] = o_stats.error(o_proj.weight)
    if simple:  # the rest of the layer from the captured features: no second attention or MLP input pass
        down = s_layer.mlp.down_proj
        m_stats = RidgeStats(down.in_features, down.out_features) if "mlp" in stages else None
        mids, feats = [], []
        for b in range(len(x_t)):
            mid = x_s[b] + o_proj(s_feats[b])
            with _inputs(down) as f:
                s_layer.mlp(s_layer.post_attention_layernorm(mid))
            if m_stats is not None:
                m_stats.add(f[0], t_next[b] - mid - (down.bias if down.bias is not None else 0.0))
            mids.append(mid)
            feats.append(f[0])
        if m_stats is not None:
            errors["mlp_before"] = m_stats.error(down.weight)
            down.weight.copy_(m_stats.solve(down.weight, ridge).to(down.weight.dtype))
            errors["mlp_after"] = m_stats.error(down.weight)
        nexts = [mid + down(f) for mid, f in zip(mids, feats)]
    else:
        nexts = [s_layer(x_s[b], cos, sin, None, kv_s[b]) for b in range(len(x_t))]
    err = ref = 0.0
    for b in range(len(x_t)):
        x_s[b], x_t[b] = nexts[b], t_next[b]
        err += float((x_s[b] - x_t[b]).double().square().sum())
        ref += float(x_t[b].double().square().sum())
    errors["stream_error"] = err / max(ref, 1e-300)  # relative squared error of the residual stream after it
