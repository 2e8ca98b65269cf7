"""Attention of reconstruction layers over other layers' paged KV caches in vLLM (paper Sec. 3.2, Eq. 4-5).

A reconstruction layer i attends over

    K^i = sum_s a_s (.) K^s        V^i = sum_s b_s (.) V^s

built from storage layers' post-RoPE caches (a weight of None: plain reuse). In vLLM the layer is an
`Attention` with `kv_sharing_target_layer_name` (so it owns no cache blocks) whose `impl` is replaced
by `CrossLayerAttention`, which reads the source layers' cache tensors from the forward context. Its fusion
is the model's own: the layer's frozen `KVSources` (`fusedkv.model.fusion.KVFusion.frozen`: the checkpoint's
weights, the iterative chain unrolled by the model's code, this rank's KV heads), put each step on the sources'
cache views (`KVSources.on`). Nothing fused is ever written; the factored identity (paper Sec. 3.3) moves the
fusion weights:

    q . (sum_s a_s (.) k_s) = sum_s (a_s (.) q) . k_s        P (sum_s b_s (.) V_s) = sum_s b_s (.) (P V_s)

The ways to evaluate it (a "path"), chosen once per layer by the engine's selection
(`fusedkv.engine.selection.select_paged_attention`), which serving's weight loading asks through
`select_paths`; nothing re-checks per call:

  * one K source (YOCO-like reuse with another V, Lite, single-source scaling, reversed maps): vLLM's
    own CPU attention op, called with the K source's key cache and each V source's value cache (the op
    takes them as separate arguments), on the query times a_s; the outputs are summed with weights
    b_s (`VllmOpPath`, here). Lite is one op call over (K^n, V^1): no copies at all.
  * two K sources on CPU (FusedKV, the iterative variant): the native kernel over the blocks in place
    (`paged_native`).
  * a GPU backend (vLLM's FlashAttention or Triton backend): decode rows in the paged Triton kernel
    (`paged_triton`).
  * where no kernel applies (no C compiler, more than two sources as in dense fusion, a block layout the native
    kernel does not read, a GPU the Triton kernel does not run on): the blocks of each sequence gathered and
    attended with the model's reference attention (`paged_gathered`, which also serves the kernels' prefill
    chunks: the one gather path).

An 8-bit cache (`--kv-cache-dtype fp8`, `fp8_e4m3`, `fp8_e5m2`) holds fp8(x / scale) per source layer, with one
scale for its keys and one for its values: every path reads the codes in place as fp8 (the native kernel and the
Triton kernel decode them as loaded; a gathered copy is widened), and since the sources enter Eq. 4-5 linearly, each
source's scale is folded into its fusion weight once per call (`KVSources.scaled`); vLLM's op (one K source) takes
the source layers' scales itself.

Every path, CPU and GPU, takes the layer's sliding window (a query at p sees keys p - W < k <= p; the kernels
read no block left of it) and Gemma 2's soft cap (c tanh(s / c) on the fused scores, which the factored form of
Sec. 3.3 forms before the softmax); on GPU, ALiBi and attention sinks are refused.

How each backend lays out its cache blocks (on CPU, learned from vLLM's own cache-write op), how the caches are
split into keys and values and how a sequence's blocks are gathered: `fusedkv.serving.paged_blocks`.
"""

from __future__ import annotations

import functools

import torch

from ..kernels.reference import weigh_rows
from ..model.attention import ReferenceAttention
from ..model.fusion import KVSources
from .paged_blocks import (
    FP8_FORMATS,
    GPU_PAGED_IMPLS,
    cache_element_dtype,
    cpu_cache_layout,
    kernel_layout,
    split_cpu_kv_cache,
    split_gpu_kv_cache,
)
from .paged_gathered import BlockReader, GatheredPath
from .paged_native import NativePath, StorageAttention
from .paged_triton import TritonPath


def layer_window(sliding_window, on_gpu: bool) -> int | None:
    """A backend impl's `sliding_window` as the window W of the model's convention (a query at position p sees
    keys p - W < k <= p), None for no window. vLLM's CPU backend holds W (-1: none); its FlashAttention and
    Triton backends hold FlashAttention's `window_size` pair (W - 1, 0), keys p - (W - 1) .. p ((-1, -1): none)."""
    if not on_gpu:
        return None if sliding_window in (None, -1) else int(sliding_window)
    left, right = tuple(sliding_window)
    if (left, right) == (-1, -1):
        return None
    if left < 0 or right != 0:
        raise NotImplementedError(f"sliding window {(left, right)}: FusedKV reconstruction layers take causal "
                                  "windows (W - 1, 0) only")
    return left + 1


class VllmOpPath:
    """One K source: vLLM's CPU attention op over the raw caches (an 8-bit cache's codes, which the op dequantises
    with the source layers' scales), once per V source, the key weight on the query and each value weight on its
    output (the factored identity): `path(q, sources, meta, out, layers)`."""

    def __init__(self, layer):
        self.layer = layer

    def __call__(self, q: torch.Tensor, sources: KVSources, meta, out: torch.Tensor, layers) -> None:
        from vllm import _custom_ops as ops

        layer, base = self.layer, self.layer.base
        key_cache = split_cpu_kv_cache(layers[layer.k_layers[0]].kv_cache)[0]
        values = [split_cpu_kv_cache(layers[n].kv_cache)[1] for n in layer.v_layers]
        q = weigh_rows(q, layer.fusion.key_weights[0])
        for i, (value_cache, w, v_layer) in enumerate(zip(values, layer.fusion.value_weights, layer.v_layers)):
            target = out if i == 0 and w is None else torch.empty_like(out)
            ops.cpu_attention_with_kv_cache(
                query=q.contiguous(), key_cache=key_cache, value_cache=value_cache, output=target,
                query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens, scale=base.scale,
                causal=meta.causal, alibi_slopes=base.alibi_slopes, sliding_window=base.sliding_window,
                block_table=meta.block_table, softcap=base.logits_soft_cap,
                scheduler_metadata=meta.scheduler_metadata, s_aux=base.sinks,
                dynamic_causal=meta.dynamic_causal, k_scale=layers[layer.k_layers[0]]._k_scale_float,
                v_scale=layers[v_layer]._v_scale_float, kv_cache_dtype=base.kv_cache_dtype)
            if target is out:
                continue
            target = weigh_rows(target, w)
            if i == 0:
                out.copy_(target)
            else:
                out.add_(target)


class CrossLayerAttention:
    """Stands in for a reconstruction layer's backend `impl` (see the module docstring).

    `k_layers` / `v_layers`: attention-layer names of the sources. The layer's fusion (a `KVSources` over no
    tensors) is given once its weights have loaded (`take`), and how it attends once, by `use` (from `select_paths`,
    at weight loading); before that it refuses to run."""

    def __init__(self, base_impl, k_layers: list[str], v_layers: list[str]):
        # The backend is recognised by class name: each backend module imports only on its own platform build.
        names = {c.__name__ for c in type(base_impl).__mro__}
        self.on_gpu = bool(names & set(GPU_PAGED_IMPLS))
        if "CPUAttentionBackendImpl" not in names and not self.on_gpu:
            raise NotImplementedError(
                f"FusedKV reconstruction layers that read two different layers (Lite, FusedKV, custom source "
                f"maps) run on vLLM's CPU, FlashAttention and Triton attention backends, not on "
                f"{type(base_impl).__name__}; plans whose upper layers reuse one layer's K and V (vanilla, GQA, "
                "CLA, YOCO) run on any backend")
        self.fp8 = FP8_FORMATS.get(base_impl.kv_cache_dtype)  # an 8-bit cache's code format, else None
        if base_impl.kv_cache_dtype not in ("auto", "float32", "bfloat16", "float16") and self.fp8 is None:
            raise NotImplementedError(
                f"kv_cache_dtype={base_impl.kv_cache_dtype!r}: FusedKV reconstruction layers read unquantised caches "
                f"and vLLM's fp8 caches ({', '.join(FP8_FORMATS)})")
        if self.on_gpu and (base_impl.alibi_slopes is not None or getattr(base_impl, "sinks", None) is not None):
            raise NotImplementedError("FusedKV reconstruction layers on GPU take causal attention with an optional "
                                      "sliding window and soft cap (no ALiBi or sinks)")
        # The layer's window W (None: none) and soft cap c (None: none), as the model has them (a query at p
        # sees keys p - W < k <= p); the backends hold the window in their own forms (`layer_window`).
        self.window = layer_window(base_impl.sliding_window, self.on_gpu)
        self.softcap = base_impl.logits_soft_cap or None
        # The model's own attention (fuse, then SDPA or the soft-capped softmax), for gathered rows and chunks.
        self.reference = ReferenceAttention(base_impl.scale, base_impl.num_heads != base_impl.num_kv_heads,
                                            self.softcap)
        self.split = split_cpu_kv_cache if not self.on_gpu else functools.partial(
            split_gpu_kv_cache, head_dim=base_impl.head_size)  # the backend's (key, value) views of a cache
        self.base = base_impl
        self.k_layers, self.v_layers = list(k_layers), list(v_layers)
        self.fusion: KVSources | None = None  # the layer's weights, once loaded (`take`)
        self.path: str | None = None  # one of fusedkv.engine.selection.PAGED_PATHS, once selected
        self.layout: tuple = (None, None)  # the CPU backend's key / value block layouts (`paged_blocks.block_layout`)
        self.kernel_layout: int | None = None  # the native kernel's name for them (`kernel_layout`)
        self.step_rows = False  # its sources keep their rows of a step (`StorageAttention`), read by prefill
        self._attend = self._unselected
        self._one_block_table = not self.on_gpu  # GPU: checked at the first step with metadata

    def __getattr__(self, name):  # backend attributes the runner reads (sliding_window, scale, ...)
        return getattr(self.base, name)

    def process_weights_after_loading(self, act_dtype):
        self.base.process_weights_after_loading(act_dtype)

    def take(self, fusion: KVSources) -> None:
        """Attend over `fusion` (the layer's frozen `KVSources`, this rank's KV heads) from now on. A source named
        twice is read once, its weights merged (`KVSources.distinct`), so every path sees distinct sources."""
        self.fusion, k_layers, v_layers = fusion.distinct(self.k_layers, self.v_layers)
        self.k_layers, self.v_layers = list(k_layers), list(v_layers)

    def use(self, path: str, layout: tuple = (None, None), step_rows: bool = False, graphs: bool = False) -> None:
        """Attend by `path` from now on (the engine's choice); `layout`: the CPU cache's block layouts; `step_rows`:
        every source layer is a `StorageAttention` (the native path's prefill chunks then read its rows); `graphs`:
        the model is on a CUDA device (steps may be captured as CUDA graphs)."""
        self.path, self.layout, self.kernel_layout, self.step_rows = path, layout, kernel_layout(layout), step_rows
        reader = BlockReader.gpu() if self.on_gpu else BlockReader.cpu(layout)
        paths = {"vllm_op": lambda: VllmOpPath(self),
                 "native": lambda: NativePath(self, layout, self.kernel_layout, step_rows),
                 "triton": lambda: TritonPath(self.reference, self.window, graphs),
                 "gathered": lambda: GatheredPath(reader, self.reference, self.window)}
        self._attend = paths[path]()

    def _unselected(self, *args):
        raise RuntimeError("this FusedKV reconstruction layer has no attention path: serving's weight loading "
                           "selects one (fusedkv.serving.paged.select_paths)")

    # ---- the impl interface ---------------------------------------------------------------------
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantisation is not supported by FusedKV layers")
        if attn_metadata is None:  # profiling / warm-up run: no cache yet
            return output
        from vllm.forward_context import get_forward_context

        if not self._one_block_table:
            self._check_one_block_table(attn_metadata)
        layers = get_forward_context().no_compile_layers
        t = attn_metadata.num_actual_tokens
        self._attend(query[:t], self.sources(layers), attn_metadata, output[:t], layers)
        return output

    def sources(self, layers) -> KVSources:
        """The layer's fusion over its sources' key and value caches of this step (split as the backend splits
        them); an 8-bit cache's codes viewed in their fp8 format, each source layer's scale folded into its
        weight."""
        if self.fusion is None:
            raise RuntimeError("this FusedKV reconstruction layer has no fusion weights: serving's weight loading "
                               "gives them (CrossLayerAttention.take)")
        sources = self.fusion.on([self.split(layers[n].kv_cache)[0] for n in self.k_layers],
                                 [self.split(layers[n].kv_cache)[1] for n in self.v_layers])
        if self.fp8 is None:
            return sources
        sources = sources.scaled([layers[n]._k_scale_float for n in self.k_layers],
                                 [layers[n]._v_scale_float for n in self.v_layers],
                                 (self.base.num_kv_heads, self.base.head_size))
        return sources.on([c.view(self.fp8) for c in sources.keys], [c.view(self.fp8) for c in sources.values])

    def _check_one_block_table(self, meta) -> None:
        """The kernel and the gather read every source through this layer's block table (its KV-cache group's, its
        first K source's). On GPU, vLLM's hybrid KV-cache manager can give a sliding-window hybrid's layers of one
        type several groups, each with its own block table: a source in another group would be read at the wrong
        blocks, so that is refused, once, at the first step with metadata (the groups are fixed by then)."""
        from vllm.forward_context import get_forward_context

        per_layer = get_forward_context().attn_metadata
        if not isinstance(per_layer, dict):  # micro-batched steps list one dict per micro-batch: checked elsewhere
            return
        ptr = meta.block_table.data_ptr()
        others = [n for n in dict.fromkeys(self.k_layers + self.v_layers)
                  if getattr(per_layer.get(n), "block_table", None) is not None
                  and per_layer[n].block_table.data_ptr() != ptr]
        if others:
            raise NotImplementedError(
                f"a FusedKV reconstruction layer reads {others} from other KV-cache groups than its own (vLLM's hybrid "
                "KV-cache manager gave them separate block tables); serve with --disable-hybrid-kv-cache-manager")
        self._one_block_table = True


def select_paths(layers: list[CrossLayerAttention], model_dtype: torch.dtype, device: torch.device,
                 block_size: int, storage: dict | None = None, compiled: bool = False) -> None:
    """Give each reconstruction layer its attention path, once, from the engine's selection (serving's
    weight loading calls this: the model's dtype, device and the cache's block size are known then).

    `storage`: the storage layers' vLLM `Attention` modules by layer name. The source layers of a layer on the
    native path get a `StorageAttention` impl (copying its rows where the model is `compiled`), so that its
    whole-sequence prefill chunks read this step's rows instead of the cache."""
    from ..engine.selection import select_paged_attention

    storage = storage or {}
    for impl in layers:
        dtype = cache_element_dtype(impl.kv_cache_dtype, model_dtype)
        layout = (None, None)
        if not impl.on_gpu and len(impl.k_layers) > 1:
            layout = cpu_cache_layout(model_dtype, dtype, impl.kv_cache_dtype, block_size, impl.head_size)
        path = select_paged_attention(impl.k_layers, impl.v_layers, gpu=impl.on_gpu, head_dim=impl.head_size,
                                      device=device, dtype=dtype, query_dtype=model_dtype,
                                      native_layout=kernel_layout(layout))
        sources = impl.k_layers + impl.v_layers
        # An 8-bit cache's chunks read the codes back (the rows of the step are not yet rounded to them).
        step_rows = path == "native" and impl.fp8 is None and all(n in storage for n in sources)
        if step_rows:
            for n in sources:
                if not isinstance(storage[n].impl, StorageAttention):
                    storage[n].impl = StorageAttention(storage[n].impl, copy=compiled)
        impl.use(path, layout, step_rows, graphs=device.type == "cuda")
