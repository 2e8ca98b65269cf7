"""Multi-head latent attention (DeepSeek-V2/V3 MLA) of FusedKV models served by vLLM, over vLLM's paged cache.

Why not vLLM's own MLA: its CPU build has an MLA backend (`CPU_MLA`, v1/attention/backends/mla/cpu_mla.py,
vLLM 0.32) but it runs only a 576-wide latent cache (kv_lora_rank 512 + qk_rope_head_dim 64, the decode
op `mla_decode_kvcache_cpu` is compiled for that size alone), only block size 16, and refuses KV sharing
("KV sharing is not supported for MLA"); it is chosen only for vLLM's own DeepSeek model types. FusedKV's
reconstruction layers (paper App. A.6: c^i = sum_s a_s (.) c^s, k_R^i = sum_s w_s (.) k_R^s) must read
other layers' latents, so this module serves MLA with the model's own arithmetic instead:

  * a storage layer owns cache blocks through a plain vLLM `Attention` used only as a cache allocation
    (`latent_cache_spec`: KV heads x head size 32 whose 2 * heads * 32 values per token hold the latent
    c and the RoPE key k_R, padded to a multiple of 64). vLLM's attention op never runs on it: the
    layer writes (c, k_R) into its own slots and attends itself;
  * a reconstruction layer owns no blocks: it reads its sources' (c, k_R) through the same block table
    (every layer is in one KV-cache group), fuses them with its `LatentFusion` weights, and attends;
  * attention: the batch's one-token (decode) requests together in the absorbed form, as `fusedkv generate`
    decodes (`fusedkv.engine.backends.absorbed_attention`: W_UK on the query, W_UV on the output, fusion
    weights on both, so no latent is expanded per head), their latents gathered and padded to the longest;
    prefill chunks per request in the model's `ExpandedAttention` (per head K/V through kv_b_proj,
    SDPA with the causal pattern of a chunk that may start mid-sequence). Greedy tokens equal `fusedkv
    generate`'s in float32. The gathers copy the latents (vLLM's MLA op cannot read these caches, above).

Parameter names, the query paths (q_lora_rank on or off), interleaved RoPE and YaRN's mscale are the
model's `fusedkv.model.mla.MLA`'s, which `ServedMLA` subclasses. Under torch.compile the attention
runs as one opaque custom op (`torch.ops.vllm.fusedkv_mla`) that finds its layer in the forward context.
"""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.utils.torch_utils import direct_register_custom_op

from ..engine.backends import absorbed_attention
from ..model.fusion import KVSources
from ..model.layers import apply_rope, rope_inv_freq, rope_tables
from ..model.mla import MLA, ExpandedAttention
from ..plan import LayerKV

CACHE_HEAD_SIZE = 32  # a head size vLLM's CPU attention backend accepts (its spec is checked at start-up)


def latent_cache_heads(config) -> int:
    """KV heads of CACHE_HEAD_SIZE (K and V halves) that hold one token's latent and RoPE key."""
    return -(-(config.kv_lora_rank + config.qk_rope_head_dim) // (2 * CACHE_HEAD_SIZE))


def cache_layer_name(model_prefix: str, index: int) -> str:
    return f"{model_prefix}.layers.{index}.self_attn.attn"


class ServedMLA(MLA):
    """`forward(positions [T], hidden_states [T, hidden]) -> [T, hidden]` of one MLA layer under vLLM."""

    def __init__(self, config, layer: LayerKV, cache_config, model_prefix: str, prefix: str):
        super().__init__(config, layer)
        self.layer_name = prefix
        inv_freq, self.rope_scaling = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # The cache layers (vLLM `Attention`s that own blocks) read for the RoPE keys and for the latents.
        own = [layer.index] if layer.stores else None
        self.key_layers = [cache_layer_name(model_prefix, i) for i in own or layer.k_sources]
        self.value_layers = [cache_layer_name(model_prefix, i) for i in own or layer.v_sources]
        if cache_config.cache_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"kv_cache_dtype={cache_config.cache_dtype}: the plugin's MLA layers keep their latents "
                             "unquantised; serve with the default (auto)")
        if layer.stores:
            heads = latent_cache_heads(config)
            self.attn = Attention(heads, CACHE_HEAD_SIZE, 1.0, num_kv_heads=heads, cache_config=cache_config,
                                  prefix=f"{prefix}.attn")
        # What the attention reads: a storage layer its own (c, k_R), a reconstruction layer its fusion as loaded.
        self.frozen_fusion = KVSources((), (None,), (), (None,)) if layer.stores else None
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate layer name {prefix!r}")
        context[prefix] = self

    def freeze_fusion(self) -> None:
        """Take the layer's fusion as loaded (`KVFusion.frozen`: MLA's latent is not split by head, so every row)."""
        self.frozen_fusion = self.fusion.frozen()

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states[None]  # [1, T, hidden]: the model's layout, one batch row of all tokens
        t = x.shape[1]
        cos, sin = rope_tables(positions[None], self.inv_freq, x.dtype, self.rope_scaling)  # [1, 1, T, d_R]
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(1, t, self.num_heads, self.qk_dim).transpose(1, 2).split(
            [self.nope_dim, self.rope_dim], dim=-1)
        q_rope = apply_rope(self._rope_layout(q_rope), cos, sin)
        new = None
        if self.layer.stores:
            latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
            latent = self.kv_a_layernorm(latent)[0]  # [T, r]
            k_rope = apply_rope(self._rope_layout(k_rope.unsqueeze(1)), cos, sin)[0, 0]  # [T, d_R]
            new = torch.cat((latent, k_rope), dim=-1)
        out = hidden_states.new_empty(t, self.num_heads * self.v_dim)
        torch.ops.vllm.fusedkv_mla(q_nope[0].contiguous(), q_rope[0].contiguous(), new, out, self.layer_name)
        return self.o_proj(out)

    # ---- inside the custom op: eager, with vLLM's forward context -----------------------------------
    def paged_attention(self, q_nope: torch.Tensor, q_rope: torch.Tensor, new: torch.Tensor | None, out: torch.Tensor):
        """q_nope [N, T, d_nope], q_rope [N, T, d_R], new (c ; k_R) rows [T, r + d_R] of a storage layer;
        writes the attention output [T, N * d_v] into `out`."""
        out.zero_()
        context = get_forward_context()
        metadata = context.attn_metadata
        meta = metadata.get(self.value_layers[0]) if isinstance(metadata, dict) else None
        if meta is None:  # profiling / warm-up runs: no cache yet
            return
        caches = {name: context.no_compile_layers[name].kv_cache for name in {*self.key_layers, *self.value_layers}}
        block_size = next(iter(caches.values())).shape[2]
        rows = {name: token_rows(cache) for name, cache in caches.items()}
        r, width = self.kv_lora_rank, self.kv_lora_rank + self.rope_dim
        n = meta.num_actual_tokens
        if new is not None:
            own = rows[self.value_layers[0]]
            own[meta.slot_mapping[:n].long(), :width] = new[:n].to(own.dtype)
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        decodes = [i for i in range(len(starts) - 1) if starts[i + 1] - starts[i] == 1]
        if decodes:
            self._decode_rows(decodes, starts, q_nope, q_rope, out, rows, meta, block_size)
        for i in range(len(starts) - 1):
            a, b = starts[i], starts[i + 1]
            if b - a <= 1:  # none, or a decode row (above)
                continue
            s, q_len = seq_lens[i], b - a
            blocks = meta.block_table[i, : -(-s // block_size)].long()
            slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:s]
            sources = self.frozen_fusion.on(
                [rows[name][slots, r:width][None, None].to(q_nope.dtype) for name in self.key_layers],
                [rows[name][slots, :r][None, None].to(q_nope.dtype) for name in self.value_layers])
            # Query j of this chunk sits at position s - q_len + j and sees keys 0 .. s - q_len + j.
            mask = torch.arange(s)[None, :] <= torch.arange(s - q_len, s)[:, None]
            # The model's own MLA attention (fuse, expand per head, SDPA).
            o = ExpandedAttention()(self, q_nope[None, :, a:b], q_rope[None, :, a:b], sources, mask, False)
            out[a:b] = o[0].transpose(0, 1).reshape(q_len, -1).to(out.dtype)


    def _decode_rows(self, requests, starts, q_nope, q_rope, out, rows, meta, block_size):
        """Every one-token request of the batch at once, absorbed (DeepSeek-V2 Sec. 2.1.2: W_UK on the query,
        W_UV on the output, so the latents are never expanded per head): each request's slots gathered and
        padded to the longest, the padding masked, the fusion weights on the query and the output."""
        r, width = self.kv_lora_rank, self.kv_lora_rank + self.rope_dim
        index = torch.tensor(requests)
        lens = meta.seq_lens[index].long()
        num_blocks = -(-int(lens.max()) // block_size)
        # Table entries past a shorter request's end are not its blocks: any valid slot will do (masked).
        last_block = next(iter(rows.values())).shape[0] // block_size - 1
        blocks = meta.block_table[index, :num_blocks].long().clamp(0, last_block)
        slots = (blocks[:, :, None] * block_size + torch.arange(block_size)).reshape(len(requests), -1)
        valid = torch.arange(slots.shape[1])[None, :] < lens[:, None]  # [R, S]

        def gather(name: str, lo: int, hi: int) -> torch.Tensor:  # [R, 1, S, hi - lo], zero past the end
            # (a masked key's probability is 0, but 0 x NaN is NaN: a freed slot may hold anything)
            return rows[name][slots, lo:hi].to(q_nope.dtype).masked_fill_(~valid[..., None], 0)[:, None]

        sources = self.frozen_fusion.on([gather(n, r, width) for n in self.key_layers],
                                        [gather(n, 0, r) for n in self.value_layers])
        tokens = torch.tensor([starts[i] for i in requests])
        o = absorbed_attention(self, q_nope[:, tokens].transpose(0, 1)[:, :, None],  # [R, N, 1, d]
                               q_rope[:, tokens].transpose(0, 1)[:, :, None], sources, valid[:, None, None, :])
        out[tokens] = o[:, :, 0].reshape(len(requests), -1).to(out.dtype)


def token_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """A cache [num_blocks, heads, block, 2 * 32] as one row per slot [num_blocks * block, 2 * heads * 32]
    (a view: this module alone writes and reads these caches, so its own row layout holds)."""
    num_blocks, heads, block, width = kv_cache.shape
    return kv_cache.view(num_blocks, block, heads * width).view(num_blocks * block, heads * width)


def _mla(q_nope: torch.Tensor, q_rope: torch.Tensor, new: torch.Tensor | None, out: torch.Tensor,
         layer_name: str) -> None:
    get_forward_context().no_compile_layers[layer_name].paged_attention(q_nope, q_rope, new, out)


def _mla_fake(q_nope: torch.Tensor, q_rope: torch.Tensor, new: torch.Tensor | None, out: torch.Tensor,
              layer_name: str) -> None:
    return None


direct_register_custom_op(op_name="fusedkv_mla", op_func=_mla, mutates_args=["out"], fake_impl=_mla_fake)


def make_mla(config, layer: LayerKV, cache_config, model_prefix: str, prefix: str) -> ServedMLA | None:
    """The attention of layer `layer` when the model uses latent attention (kv_lora_rank set), else None."""
    if config.kv_lora_rank is None:
        return None
    return ServedMLA(config, layer, cache_config, model_prefix, prefix)
