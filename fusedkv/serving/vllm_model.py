"""The FusedKV decoder written with vLLM's layers, loading checkpoints saved by `save_pretrained`.

Same architecture as `fusedkv.model`: the Qwen3 block and every feature of the imported dense families
(`fusedkv convert`: Llama, Mistral, Qwen2, Gemma 2/3), each decided once from the config's fields:
Q/K/V and MLP biases, QK-norm or none, Gemma's RMSNorm (1 + w) and its post-norms, embedding scaling,
the gated MLP with the config's `hidden_act` (transformers' own function), `query_pre_attn_scalar`,
attention and final logit soft-capping (vLLM's attention and logits processor apply them), sliding-window
layers (vLLM's per-layer window) and RoPE of every scaling type with a base per attention type. Each layer's
attention follows the plan: multi-head (`vllm_attention`) or latent (`vllm_mla`); its MLP is the gated MLP or a
mixture of experts (`vllm_moe`).

The iterative fusion variant (paper Sec. 3.4: K^i = c_i (.) K^{i-1} + f_i (.) K^1, starting from K^n) is
linked as the transformers model links it (`fusedkv.model.fusion.link_iterative_chains`), so each layer's frozen
fusion is the chain unrolled by the model's own code into two-source weights, served like FusedKV.

Imports from the project only what runs under vLLM's transformers (where the project's HF model does
not): `fusedkv.config`, `fusedkv.plan`, the model's fusion, attention and RoPE modules and the reference kernels.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers.activations import ACT2FN
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CompilationMode, VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.sequence import IntermediateTensors

from ..model.fusion import link_iterative_chains
from ..plan import LayerKV
from .paged import CrossLayerAttention, select_paths
from .plugin import check_servable
from .vllm_attention import FusedKVAttention, attention_layer_name, make_norm
from .vllm_mla import make_mla
from .vllm_moe import FusedSparseMoE, choose_moe_path, make_moe_mlp


def check_backend_runs(config, vllm_config: VllmConfig) -> None:
    """Refuse, while the model loads, a layer shape the CPU attention backend would refuse only at the first
    request (for users of `vllm serve`; `fusedkv serve` checks before starting vLLM): its kernels are asked by
    running them (`cpu_probe`)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and config.kv_lora_rank is None:  # MLA caches use vllm_mla's own head size
        from .cpu_probe import attention_runs

        cache = vllm_config.cache_config
        dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        reason = attention_runs(config.head_dim, config.num_attention_heads, config.num_key_value_heads, dtype,
                                cache.block_size or 128, cache.cache_dtype)
        if reason is not None:
            raise ValueError(f"head_dim={config.head_dim}, kv cache {cache.cache_dtype}: vLLM's CPU attention does "
                             f"not run this on this processor ({reason})")


def check_parallel(config, parallel) -> None:
    """Tensor parallel runs the multi-head attention layers sharded by head (`rank_heads`) and vLLM's parallel
    linear layers; pipeline parallel is refused (see docs/serving.md, "Tensor and pipeline parallel")."""
    if parallel.pipeline_parallel_size != 1:
        raise ValueError("the FusedKV vLLM plugin runs pipeline parallel size 1 (vLLM's CPU build does not run "
                         "pipeline stages; see docs/serving.md); use tensor parallel")
    if parallel.tensor_parallel_size != 1 and (config.kv_lora_rank is not None or getattr(config, "num_experts", 0)):
        raise ValueError("tensor parallel with the FusedKV plugin runs multi-head attention models with dense MLPs; "
                         "latent attention (MLA) and mixture-of-experts models run with tensor parallel size 1")


def make_attention(config, layer: LayerKV, cache_config, quant_config, model_prefix: str, prefix: str) -> nn.Module:
    """The attention module of one decoder layer: `forward(positions, hidden_states) -> hidden_states`.
    The one place that chooses it: latent attention (MLA, `vllm_mla`) or the multi-head kind."""
    return make_mla(config, layer, cache_config, model_prefix, prefix) or FusedKVAttention(
        config, layer, cache_config, quant_config, model_prefix, prefix)


def make_mlp(config, layer: LayerKV, quant_config, prefix: str, moe_path: str | None) -> nn.Module:
    """The MLP of one decoder layer: `forward(hidden_states) -> hidden_states`. The one place that chooses
    it: a mixture of experts on `moe_path` (`vllm_moe.choose_moe_path`, decided once per model) or the gated
    MLP."""
    def gated(size: int, prefix: str, act: str = "silu", bias: bool = False) -> GatedMLP:
        return GatedMLP(config.hidden_size, size, act, bias, quant_config, prefix)

    # DeepSeekMoE's shared experts: a bias-free SwiGLU (the model's `SwiGLU` default).
    return make_moe_mlp(config, layer.index, prefix, gated, moe_path) or gated(
        config.intermediate_size, prefix, config.hidden_act, config.mlp_bias)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer: LayerKV, cache_config, quant_config, model_prefix: str, prefix: str,
                 moe_path: str | None):
        super().__init__()
        self.self_attn = make_attention(config, layer, cache_config, quant_config, model_prefix, f"{prefix}.self_attn")
        self.mlp = make_mlp(config, layer, quant_config, f"{prefix}.mlp", moe_path)
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)  # before the MLP
        # Gemma 2/3 also normalise each block's output before the residual add (the checkpoint's names).
        self.post_norms = config.use_post_norms
        if self.post_norms:
            self.post_attention_output_layernorm = make_norm(config, config.hidden_size)
            self.post_feedforward_layernorm = make_norm(config, config.hidden_size)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        if self.post_norms:
            hidden_states = self.post_attention_output_layernorm(hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        if self.post_norms:
            hidden_states = self.post_feedforward_layernorm(hidden_states)
        return hidden_states, residual


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with the config's `hidden_act`: vLLM's SiluAndMul for SwiGLU, transformers'
    own function (as the model's `SwiGLU` uses) for the others (Gemma's tanh-GELU)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool, quant_config,
                 prefix: str):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj")
        self.silu = hidden_act in ("silu", "swish")
        self.act_fn = SiluAndMul() if self.silu else ACT2FN[hidden_act]

    def forward(self, x):
        x, _ = self.gate_up_proj(x)
        if self.silu:
            x = self.act_fn(x)
        else:
            gate, up = x.chunk(2, dim=-1)
            x = self.act_fn(gate) * up
        x, _ = self.down_proj(x)
        return x


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "intermediate_tensors": 0,
                                         "inputs_embeds": 0})
class FusedKVModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        check_servable(config)
        check_backend_runs(config, vllm_config)
        check_parallel(config, vllm_config.parallel_config)
        self.config, self.plan = config, config.plan
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=f"{prefix}.embed_tokens")
        moe_path = choose_moe_path(config)
        self.layers = nn.ModuleList(
            DecoderLayer(config, layer, vllm_config.cache_config, vllm_config.quant_config, prefix,
                         f"{prefix}.layers.{layer.index}", moe_path)
            for layer in self.plan.layers)
        # The iterative variant: each layer's fusion continues the previous one's recurrence, as in the model.
        link_iterative_chains((d.self_attn.fusion for d in self.layers if not d.self_attn.layer.stores),
                              config.fusion_init)
        self.norm = make_norm(config, config.hidden_size)
        # Gemma scales the embeddings by sqrt(hidden_size) rounded to the model's dtype first, as the model does.
        self.embedding_multiplier = float(config.embedding_multiplier)
        if self.embedding_multiplier != 1.0:
            self.register_buffer("embedding_scale", torch.tensor(self.embedding_multiplier), persistent=False)
        max_len = vllm_config.model_config.max_model_len
        if max_len > config.max_position_embeddings:
            raise ValueError(f"max_model_len={max_len} exceeds the model's max_position_embeddings="
                             f"{config.max_position_embeddings} (its RoPE tables end there); lower --max-model-len")
        # Prefill skipping (paper Sec. 3.3): with vLLM's --kv-sharing-fast-prefill, the layers from
        # here on (reconstruction layers only: they write no cache) run on the positions whose logits
        # are sampled, not on the whole prompt. vLLM gives those layers' attention metadata for
        # exactly those positions.
        self.skip_from = self.plan.first_skippable_layer
        self.fast_prefill = vllm_config.cache_config.kv_sharing_fast_prefill and self.skip_from < len(self.layers)
        if self.fast_prefill and vllm_config.compilation_config.mode != CompilationMode.NONE:
            raise ValueError("--kv-sharing-fast-prefill with the FusedKV plugin needs --enforce-eager (the skipped "
                             "layers take a data-dependent subset of the positions)")
        self.first_skipped_attention = attention_layer_name(prefix, self.skip_from)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * self.embedding_scale.to(x.dtype) if self.embedding_multiplier != 1.0 else x

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden_states = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        logits_rows = self._fast_prefill_rows()
        if logits_rows is None:
            for layer in self.layers:
                hidden_states, residual = layer(positions, hidden_states, residual)
            hidden_states, _ = self.norm(hidden_states, residual)
            return hidden_states
        for layer in self.layers[: self.skip_from]:
            hidden_states, residual = layer(positions, hidden_states, residual)
        rows, num_rows = logits_rows
        h, r, pos = hidden_states[rows], residual[rows], positions[rows]
        for layer in self.layers[self.skip_from:]:
            h, r = layer(pos, h, r)
        h, _ = self.norm(h, r)
        out = torch.zeros_like(hidden_states)  # positions without logits are never read
        out[rows[:num_rows]] = h[:num_rows]
        return out

    def _fast_prefill_rows(self):
        """(row indices, how many are real) when the skipped layers run on a subset this step, else None."""
        if not self.fast_prefill:
            return None
        metadata = get_forward_context().attn_metadata
        if not isinstance(metadata, dict) or self.first_skipped_attention not in metadata:
            return None  # profiling / warm-up runs
        meta = metadata[self.first_skipped_attention]
        rows = getattr(meta, "logits_indices_padded", None)
        if rows is None or getattr(meta, "num_logits_indices", None) is None:
            return None
        return rows, meta.num_logits_indices


class FusedKVForCausalLM(nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model_dtype, self.block_size = vllm_config.model_config.dtype, vllm_config.cache_config.block_size
        self.compiled = vllm_config.compilation_config.mode != CompilationMode.NONE
        self.model = FusedKVModel(vllm_config=vllm_config, prefix=_join(prefix, "model"))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=_join(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size, soft_cap=config.final_logit_softcapping)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds=None):
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.logits_processor(self.lm_head, hidden_states)
        # NaN logits would be sampled as some token and answered with HTTP 200 and empty text: fail
        # instead (vLLM answers 500 and stops; `fusedkv serve` exits 1 naming this line).
        if logits is not None and not torch.isfinite(logits).all():
            raise FloatingPointError("the model produced non-finite logits (NaN or Inf): its weights or activations "
                                     "overflow in this dtype; check the checkpoint, or serve it in float32")
        return logits

    # ---- checkpoint loading -----------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint names are the HF model's; storage layers' q/k/v and every gate/up pair load into
        vLLM's stacked projections. Fails naming the first checkpoint tensor the model has no place for."""
        stacked = [(".self_attn.q_proj.", ".self_attn.qkv_proj.", "q"),
                   (".self_attn.k_proj.", ".self_attn.qkv_proj.", "k"),
                   (".self_attn.v_proj.", ".self_attn.qkv_proj.", "v"),
                   (".mlp.gate_proj.", ".mlp.gate_up_proj.", 0),
                   (".mlp.up_proj.", ".mlp.gate_up_proj.", 1),
                   (".shared_experts.gate_proj.", ".shared_experts.gate_up_proj.", 0),
                   (".shared_experts.up_proj.", ".shared_experts.gate_up_proj.", 1)]
        params = {**dict(self.named_buffers()), **dict(self.named_parameters())}  # buffers: MoE score bias
        fused_moe = {name: m for name, m in self.named_modules() if isinstance(m, FusedSparseMoE)}
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            owner, _, leaf = name.rpartition(".experts.")
            if owner in fused_moe:  # stacked experts: vLLM's FusedMoE takes them in its own layout
                loaded.update(f"{owner}.{p}" for p in fused_moe[owner].load_experts(leaf, tensor))
                continue
            if name in params:  # direct: embeddings, norms, o_proj, reconstruction layers' q_proj, fusion
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(name)
                continue
            for old, new, shard in stacked:
                if old in name and name.replace(old, new) in params:
                    param = params[name.replace(old, new)]
                    param.weight_loader(param, tensor, shard)
                    loaded.add(name.replace(old, new))
                    break
            else:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the FusedKV model of this config; the "
                                 "checkpoint and its config.json disagree (re-save it with save_pretrained)")
        for decoder in self.model.layers:  # what each reconstruction layer attends over, frozen once loaded
            if not decoder.self_attn.layer.stores:
                decoder.self_attn.freeze_fusion()
        # How every reconstruction layer attends, decided here once (the engine's selection); the storage layers'
        # attention modules by name, whose rows of a step the native path's prefill chunks may read.
        attns = [getattr(d.self_attn, "attn", None) for d in self.model.layers]
        storage = {a.layer_name: a for d, a in zip(self.model.layers, attns)
                   if a is not None and d.self_attn.layer.stores}
        select_paths([a.impl for a in attns if isinstance(getattr(a, "impl", None), CrossLayerAttention)],
                     self.model_dtype, self.model.embed_tokens.weight.device, self.block_size, storage, self.compiled)
        if self.config.tie_word_embeddings:
            loaded.add("lm_head.weight")
        return loaded


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
