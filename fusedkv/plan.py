"""The KV-sharing plan: which layers store a KV cache and where every other layer reads its K and V.

This is the one place that knows what "vanilla", "cla", "yoco", "fusedkv-lite" and "fusedkv" mean
(paper Sec. 2.1-2.3, Table 1). Everything else (the model, the cache, the benchmarks, the CLI table) asks the
plan instead of testing plan names. A plan is a pure, immutable value: a tuple of `LayerKV`, one per
layer, built from a plan name or a custom source map and validated once.

Layer indices are 0-based in code. The paper and the user-facing custom source maps are 1-based
("K from layer 8, V from layer 1"); `custom_plan` converts at the boundary.

Attention types: every layer has one ("full_attention" or "sliding_attention", Qwen3's names). A
reconstruction layer reads sources of one attention type (paper App. A.6, SWA hybrids): its own, or, for a
window layer, full-attention sources (a full cache holds every key; the layer's own mask applies the
window). A full layer can never read a window cache: the keys it needs are gone. The named plans pick
"first" and "middle" sources per attention type, so hybrids need no new code; a window layer with no
window layer below the split (Qwen2/Qwen3's `max_window_layers`: lower full, upper window) reads full ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FULL = "full_attention"
SLIDING = "sliding_attention"
ATTENTION_TYPES = (FULL, SLIDING)

# How a reconstruction layer combines its sources (per side, K and V separately):
#   "reuse"   one source, taken as it is (YOCO, Lite, CLA)
#   "channel" learned per-(kv head, channel) vectors, one per source (FusedKV, eq. 4-5)
#   "scalar"  one learned scalar per source (the paper's dense-fusion exploration, Fig. 2)
REUSE, CHANNEL, SCALAR = "reuse", "channel", "scalar"
FUSION_MODES = (REUSE, CHANNEL, SCALAR)

# The KV-sharing plans: which layers store K/V and where the others read it. How many KV heads a
# layer has is a separate, orthogonal setting (`num_key_value_heads`): GQA is `vanilla` with fewer KV
# heads, and FusedKV + GQA is simply both.
VANILLA = "vanilla"  # every layer stores its own K/V: the baseline of every comparison
DEFAULT_PLAN = "fusedkv"
CUSTOM = "custom"  # a user source map (`custom_plan`)
PLAN_NAMES = (VANILLA, "cla", "yoco", "fusedkv-lite", "fusedkv", "fusedkv-dense")

PLAN_DESCRIPTIONS = {
    VANILLA: "every layer stores its own K/V",
    "cla": "adjacent pairs share: layer 2j reads layer 2j-1",
    "yoco": "upper layers reuse K^n, V^n (the middle layer)",
    "fusedkv-lite": "upper layers reuse K^n and V^1",
    "fusedkv": "upper layers fuse K^1,K^n and V^1,V^n with learned channel weights",
    "fusedkv-dense": "upper layers fuse every lower layer with learned scalars (Fig. 2 analysis)",
}

# ---- what users type: a plan, optionally with shorthands -------------------------------------------
# `gqa` alone is vanilla with half the KV heads (the paper's GQA baseline, two query heads per KV
# head); `<plan>+gqa` is that plan with half the KV heads. On sliding-window hybrids (paper App. A.6)
# `<plan>+W` reconstructs only the upper window layers and `<plan>+WF` window and full layers (the
# default). Suffixes combine (`fusedkv+gqa+W`). Only `resolve_plan_choice` reads them.
GQA = "gqa"
GQA_GROUP = 2  # query heads per KV head under the shorthand
WINDOW_SHARING = {"W": (SLIDING,), "WF": (SLIDING, FULL)}  # suffix -> shared_attention_types
PLAN_CHOICES = (VANILLA, GQA, "cla", "yoco", "fusedkv-lite", "fusedkv", "fusedkv-dense")
# The rows every comparison shows by default (paper Table 1 / Table 2; fusedkv-dense is an analysis).
COMPARED_PLANS = (VANILLA, GQA, "cla", "yoco", "fusedkv-lite", "fusedkv")
# The plans the long-context decode benchmark times (paper Figs. 4-5: MHA/GQA, Lite, FusedKV).
DECODE_TIMED_PLANS = (VANILLA, "fusedkv-lite", "fusedkv")
CHOICE_DESCRIPTIONS = {**PLAN_DESCRIPTIONS, GQA: "every layer stores its own K/V, with half as many KV heads"}


@dataclass(frozen=True)
class PlanChoice:
    """A user-typed plan resolved: the sharing plan and the settings that go with it."""

    label: str  # as typed, for tables and run names
    sharing: str  # one of PLAN_NAMES or CUSTOM
    query_heads_per_kv_head: int | None  # None: keep the model's num_key_value_heads
    shared_attention_types: tuple[str, ...] | None = None  # None: the model's own setting

    def num_key_value_heads(self, num_attention_heads: int, default: int | None = None) -> int:
        """KV heads for a model with `num_attention_heads` query heads (`default`: the model's own)."""
        if self.query_heads_per_kv_head is None:
            return default or num_attention_heads
        if num_attention_heads % self.query_heads_per_kv_head:
            return num_attention_heads  # an odd head count cannot be halved: one KV head per query head
        return num_attention_heads // self.query_heads_per_kv_head

    def config_kwargs(self, num_attention_heads: int, num_key_value_heads: int | None = None) -> dict:
        """The `FusedKVConfig` arguments this choice sets, for a model with `num_attention_heads` query heads
        (`num_key_value_heads`: the model's own, kept unless the choice halves them)."""
        kwargs = dict(kv_sharing=self.sharing,
                      num_key_value_heads=self.num_key_value_heads(num_attention_heads, num_key_value_heads))
        if self.shared_attention_types is not None:
            kwargs["shared_attention_types"] = list(self.shared_attention_types)
        return kwargs


def resolve_plan_choice(name: str) -> PlanChoice:
    """`vanilla`, `gqa`, `fusedkv`, `fusedkv+gqa`, `fusedkv+W`, `custom`, ... -> the sharing plan and
    the KV-head and window-sharing settings that go with it."""
    base, *suffixes = str(name).split("+")
    unknown = [x for x in suffixes if x != GQA and x not in WINDOW_SHARING]
    windows = [x for x in suffixes if x in WINDOW_SHARING]
    if base == GQA and not suffixes:
        return PlanChoice(name, VANILLA, GQA_GROUP)
    if base in (*PLAN_NAMES, CUSTOM) and not unknown and len(windows) <= 1 and len(set(suffixes)) == len(suffixes):
        return PlanChoice(name, base, GQA_GROUP if GQA in suffixes else None,
                          WINDOW_SHARING[windows[0]] if windows else None)
    raise ValueError(
        f"unknown plan {name!r}; choose one of {', '.join(PLAN_CHOICES)} (or {CUSTOM!r} with a source map), "
        f"optionally with +{GQA} (half the KV heads) and +W or +WF (which layer types a hybrid shares)"
    )


@dataclass(frozen=True)
class LayerKV:
    """Where one layer's K and V come from.

    A storage layer reads its own K/V (`k_sources == v_sources == (index,)`, mode "reuse").
    """

    index: int
    attention_type: str
    k_sources: tuple[int, ...]
    v_sources: tuple[int, ...]
    k_fusion: str = REUSE
    v_fusion: str = REUSE

    @property
    def stores(self) -> bool:
        return self.k_sources == (self.index,) and self.v_sources == (self.index,)

    @property
    def sources(self) -> tuple[int, ...]:
        """Every storage layer this layer reads, in first-use order."""
        return tuple(dict.fromkeys(self.k_sources + self.v_sources))

    # The fusion modes as properties: nothing outside this module compares the mode names.
    @property
    def weighted(self) -> bool:
        """Either side carries learned fusion weights (not plain reuse)."""
        return self.k_fusion != REUSE or self.v_fusion != REUSE

    @property
    def scalar_weighted(self) -> bool:
        """Either side weighs its sources by one scalar each (fusedkv-dense), not per channel."""
        return SCALAR in (self.k_fusion, self.v_fusion)

    @property
    def channel_weighted(self) -> bool:
        """Both sides weigh their sources per (kv head, channel) (FusedKV, eq. 4-5)."""
        return self.k_fusion == self.v_fusion == CHANNEL

    def weight_shape(self, side: str, num_kv_heads: int, width: int) -> tuple[int, ...] | None:
        """The shape of side "k" or "v"'s fusion weights (None: a reused side has none)."""
        mode, count = (self.k_fusion, len(self.k_sources)) if side == "k" else (self.v_fusion, len(self.v_sources))
        if mode == REUSE:
            return None
        return (count, num_kv_heads, width) if mode == CHANNEL else (count,)


@dataclass(frozen=True)
class KVSharingPlan:
    name: str
    layers: tuple[LayerKV, ...]

    def __post_init__(self):
        if not self.layers:
            raise ValueError(f"plan {self.name!r} has no layers; a model needs at least one layer")
        for layer in self.layers:
            for side, srcs, mode in (("K", layer.k_sources, layer.k_fusion), ("V", layer.v_sources, layer.v_fusion)):
                if mode not in FUSION_MODES:
                    raise ValueError(
                        f"layer {layer.index + 1}: unknown {side} fusion mode {mode!r}; use one of {FUSION_MODES}"
                    )
                if not srcs:
                    raise ValueError(f"layer {layer.index + 1}: no {side} source")
                if mode == REUSE and len(srcs) != 1:
                    raise ValueError(
                        f"layer {layer.index + 1}: {side} reads {len(srcs)} sources without fusion; "
                        "set the fusion mode to 'channel' or 'scalar' to combine several sources"
                    )
                if len(set(srcs)) != len(srcs):
                    raise ValueError(f"layer {layer.index + 1}: {side} sources repeat a layer: {[s + 1 for s in srcs]}")
                for s in srcs:
                    if not 0 <= s < len(self.layers):
                        raise ValueError(
                            f"layer {layer.index + 1}: {side} source layer {s + 1} does not exist "
                            f"(the model has {len(self.layers)} layers, numbered from 1)"
                        )
                    if s != layer.index and not self.layers[s].stores:
                        raise ValueError(
                            f"layer {layer.index + 1}: {side} source layer {s + 1} is not a storage layer "
                            f"(storage layers: {[i + 1 for i in self.storage_layers]}); a reconstruction layer "
                            "can only read layers that keep their own K/V cache"
                        )
                    if s > layer.index:
                        raise ValueError(
                            f"layer {layer.index + 1}: {side} source layer {s + 1} comes after it; sources must be "
                            "earlier layers so their K/V exist when this layer runs"
                        )
                    if self.layers[s].attention_type != layer.attention_type and layer.attention_type == FULL:
                        raise ValueError(
                            f"layer {layer.index + 1} ({FULL}) reads {side} from layer {s + 1} "
                            f"({self.layers[s].attention_type}); a full-attention layer cannot read a window "
                            "cache, which no longer holds the keys it needs: give it full-attention sources"
                        )
            kinds = {self.layers[s].attention_type for s in layer.k_sources + layer.v_sources}
            if len(kinds) > 1:
                raise ValueError(
                    f"layer {layer.index + 1} reads both {FULL} and {SLIDING} sources; its sources must be of one "
                    "attention type (their caches hold different numbers of keys)"
                )
            if not layer.stores and layer.index in (layer.k_sources + layer.v_sources):
                raise ValueError(
                    f"layer {layer.index + 1} reads itself for one side and another layer for the other; "
                    "a layer either stores both K and V or neither"
                )

    # ---- structure -------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def storage_layers(self) -> tuple[int, ...]:
        return tuple(layer.index for layer in self.layers if layer.stores)

    @property
    def reconstruction_layers(self) -> tuple[int, ...]:
        return tuple(layer.index for layer in self.layers if not layer.stores)

    @property
    def first_skippable_layer(self) -> int:
        """Layers from here on store nothing, so during prefill only the positions whose outputs are
        wanted need to pass through them (paper Sec. 2.5). Equals num_layers when none can be skipped."""
        return max(self.storage_layers) + 1

    # ---- capacity and I/O, in elements per token per (kv head x head_dim) -------------------------
    def cache_elements_per_token(self) -> int:
        """K and V vectors held per token (multiply by H_kv * D * bytes for bytes)."""
        return 2 * len(self.storage_layers)

    def elements_read_per_token(self) -> int:
        """K and V vectors read per cached token in one decode step: each layer reads every source
        of each side once (a fused layer reads 2 K + 2 V tensors, paper Table 1)."""
        return sum(len(layer.k_sources) + len(layer.v_sources) for layer in self.layers)

    def describe(self) -> list[str]:
        """One line per layer, 1-based, for `fusedkv plans` and error messages."""
        lines = []
        for layer in self.layers:
            tag = "" if layer.attention_type == FULL else " [window]"
            if layer.stores:
                lines.append(f"layer {layer.index + 1:>3}{tag}: stores K/V")
            else:
                k = _side_text("K", layer.k_sources, layer.k_fusion)
                v = _side_text("V", layer.v_sources, layer.v_fusion)
                lines.append(f"layer {layer.index + 1:>3}{tag}: {k}; {v}")
        return lines


def _side_text(side: str, sources: tuple[int, ...], mode: str) -> str:
    terms = [f"{side}^{s + 1}" for s in sources]
    if mode == REUSE:
        return f"{side} = {terms[0]}"
    weight = "a" if side == "K" else "b"
    op = "(.)" if mode == CHANNEL else "*"
    return f"{side} = " + " + ".join(f"{weight}{s + 1}{op}{t}" for s, t in zip(sources, terms))


# ---- builders ------------------------------------------------------------------------------------
def storage_layer(index: int, attention_type: str) -> LayerKV:
    return LayerKV(index, attention_type, (index,), (index,))


def split_point(num_layers: int) -> int:
    """n, the number of lower layers that keep their own K/V cache under the half-split plans (yoco, Lite,
    FusedKV, dense): the upper layers n+1..L reconstruct from layer 1 and layer n (paper Sec. 2.2-2.3, where
    n = L/2, "the middle layer").

    For an odd L (DeepSeek-V3 has 61 layers, V2-Lite 27) n = ceil(L/2) = (L+1)/2: layer n is then the one
    middle layer of the stack and keeps its cache, every upper layer's sources (1 and n) lie below it, and
    the cache holds n/L = (L+1)/(2L) of vanilla's (31/61 = 50.8% for 61 layers; exactly 1/2 for an even L).
    Rounding down instead would make the middle layer a reconstruction layer and cut the cache under 1/2
    with more layers reading less. CLA pairs layers the same way: an odd last layer keeps its own cache."""
    if num_layers < 2:
        raise ValueError(
            f"num_hidden_layers={num_layers}: the half-split plans keep the K/V cache of the lower layers and "
            "reconstruct it in the upper ones, so they need at least 2 layers"
        )
    return (num_layers + 1) // 2


def build_plan(
    name: str,
    num_layers: int,
    layer_types: Sequence[str] | None = None,
    shared_types: Sequence[str] | None = None,
) -> KVSharingPlan:
    """A named plan for `num_layers` layers: the half-split plans keep the caches of the lower
    `split_point(num_layers)` layers (L/2, or (L+1)/2 for an odd L) and reconstruct the rest.

    `layer_types[i]` is layer i's attention type (default all full). `shared_types` restricts which
    attention types the upper half reconstructs (default: all); upper layers of other types keep their
    own cache. This gives the SWA hybrids of paper App. A.6: `shared_types=["sliding_attention"]` is
    "+W", the default is "+WF".
    """
    if name not in PLAN_NAMES:
        raise ValueError(
            f"unknown kv_sharing plan {name!r}; choose one of {', '.join(PLAN_NAMES)} or give a custom source map "
            f"(GQA is not a sharing plan but a KV-head count: set num_key_value_heads)"
        )
    types = list(layer_types) if layer_types is not None else [FULL] * num_layers
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries but num_hidden_layers={num_layers}; give one per layer")
    for t in types:
        if t not in ATTENTION_TYPES:
            raise ValueError(f"layer_types: unknown attention type {t!r}; use {ATTENTION_TYPES}")
    shared = set(shared_types) if shared_types is not None else set(ATTENTION_TYPES)

    if name == VANILLA:
        return KVSharingPlan(name, tuple(storage_layer(i, t) for i, t in enumerate(types)))

    if name == "cla":
        layers = []  # pairs (1, 2), (3, 4), ...; with an odd count the last layer keeps its own cache
        for i, t in enumerate(types):
            if i % 2 == 1 and t in shared and types[i - 1] == t:
                layers.append(LayerKV(i, t, (i - 1,), (i - 1,)))
            else:
                layers.append(storage_layer(i, t))
        return KVSharingPlan(name, tuple(layers))

    n = split_point(num_layers)
    layers = [storage_layer(i, t) for i, t in enumerate(types[:n])]
    for i in range(n, num_layers):
        t = types[i]
        lower = [j for j in range(n) if types[j] == t]
        if not lower and t == SLIDING:  # a window layer may read full caches (its own mask applies the window)
            lower = [j for j in range(n) if types[j] == FULL]
        if t not in shared:
            layers.append(storage_layer(i, t))
            continue
        if not lower:
            raise ValueError(
                f"layer {i + 1} is {t} but the lower half has no {t} layer to read; "
                "a reconstruction layer must take sources of its own attention type"
            )
        first, middle = lower[0], lower[-1]
        if name == "yoco":
            layers.append(LayerKV(i, t, (middle,), (middle,)))
        elif name == "fusedkv-lite":
            layers.append(LayerKV(i, t, (middle,), (first,)))
        elif name == "fusedkv":
            srcs = (first, middle) if first != middle else (first,)
            layers.append(LayerKV(i, t, srcs, srcs, CHANNEL, CHANNEL))
        else:  # fusedkv-dense
            layers.append(LayerKV(i, t, tuple(lower), tuple(lower), SCALAR, SCALAR))
    return KVSharingPlan(name, tuple(layers))
