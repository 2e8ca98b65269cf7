"""A KV-sharing plan from a user's source map (`kv_source_map` in the config; paper Sec. 4.3's source studies,
Table 17 and Fig. 8 are written this way): which layers rebuild their K/V from which storage layers, with
which fusion. The plan it returns is the same validated value `build_plan` returns (`fusedkv.plan`)."""

from __future__ import annotations

from collections.abc import Sequence

from .plan import CHANNEL, CUSTOM, FULL, REUSE, KVSharingPlan, LayerKV, storage_layer


def custom_plan(num_layers: int, source_map: Sequence[dict], layer_types: Sequence[str] | None = None) -> KVSharingPlan:
    """A plan from a user source map (1-based layer numbers, as in the paper).

    Each entry: `{"layers": [9, 16] or 9, "k": [8] or 8, "v": [1], "k_fusion": "reuse"|"channel"|"scalar",
    "v_fusion": ...}`. Layers not named store their own K/V. Fusion defaults to "channel" for two or more
    sources and "reuse" for one. Examples (16 layers): the reversed plan is
    `[{"layers": [9, 16], "k": 1, "v": 8}]`; single-source learnable scaling is
    `[{"layers": [9, 16], "k": 8, "v": 1, "k_fusion": "channel", "v_fusion": "channel"}]`.
    """
    types = list(layer_types) if layer_types is not None else [FULL] * num_layers
    targets: dict[int, LayerKV] = {}
    for entry_no, entry in enumerate(source_map, start=1):
        unknown = set(entry) - {"layers", "k", "v", "k_fusion", "v_fusion"}
        if unknown or not {"layers", "k", "v"} <= set(entry):
            raise ValueError(
                f"kv_source_map entry {entry_no} {entry!r}: needs keys 'layers', 'k', 'v' "
                f"(optional 'k_fusion', 'v_fusion'); unexpected: {sorted(unknown)}"
            )
        for i in _layer_range(entry["layers"], num_layers, entry_no):
            k, v = _as_tuple(entry["k"]), _as_tuple(entry["v"])
            kf = entry.get("k_fusion", CHANNEL if len(k) > 1 else REUSE)
            vf = entry.get("v_fusion", CHANNEL if len(v) > 1 else REUSE)
            for s in k + v:
                if not 1 <= s <= num_layers:
                    raise ValueError(f"kv_source_map entry {entry_no}: source layer {s} is outside 1..{num_layers}")
            targets[i] = LayerKV(i, types[i], tuple(s - 1 for s in k), tuple(s - 1 for s in v), kf, vf)
    layers = tuple(targets.get(i, storage_layer(i, t)) for i, t in enumerate(types))
    return KVSharingPlan(CUSTOM, layers)


def _as_tuple(x) -> tuple[int, ...]:
    return tuple(int(v) for v in x) if isinstance(x, (list, tuple)) else (int(x),)


def _layer_range(spec, num_layers: int, entry_no: int) -> range | tuple[int, ...]:
    """`9` -> (8,), `[9, 16]` -> range(8, 16) (inclusive 1-based range)."""
    if isinstance(spec, int):
        lo = hi = spec
    elif isinstance(spec, (list, tuple)) and len(spec) == 2:
        lo, hi = int(spec[0]), int(spec[1])
    else:
        raise ValueError(f"kv_source_map entry {entry_no}: 'layers' must be N or [first, last], got {spec!r}")
    if not 1 <= lo <= hi <= num_layers:
        raise ValueError(f"kv_source_map entry {entry_no}: layers {spec!r} outside 1..{num_layers}")
    return range(lo - 1, hi)
