"""`FusedKVModel` and `FusedKVForCausalLM`: a Qwen3-style decoder whose layers follow a KV-sharing plan.

The model is a transformers `PreTrainedModel`: `save_pretrained` / `from_pretrained` (safetensors),
`AutoModelForCausalLM` after `import fusedkv`, and `generate()` all work. The cache is transformers'
`DynamicCache`: only storage layers ever write to it, so reconstruction layers hold nothing and the
cache is exactly as large as the plan says (`fusedkv.cache.kv_cache_nbytes`).

Prefill skipping (paper Sec. 2.5): once every remaining layer is a reconstruction layer, their K/V no
longer depend on their own hidden states, so when only the last `logits_to_keep` positions' outputs
are wanted (as in `generate`) only those positions continue through the upper layers.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers import initialization as hf_init
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    MoeCausalLMOutputWithPast,
    MoeModelOutputWithPast,
)

from ..config import FusedKVConfig
from ..config_fields import rope_parameters_by_type
from ..plan import SLIDING
from .attention import Attention, KVState
from .fusion import KVFusion, link_iterative_chains
from .layers import RMSNorm, SwiGLU, rope_inv_freq, rope_tables
from .loss import lm_loss, shift_labels
from .mla import MLA
from .moe import Experts, Router, RouterRecord, SparseMoE, is_sparse_layer, load_balancing_loss


class DecoderLayer(nn.Module):
    def __init__(self, config: FusedKVConfig, layer_kv):
        super().__init__()
        # DeepSeek-V2/V3 multi-head latent attention when kv_lora_rank is set, else Qwen3 attention.
        self.self_attn = MLA(config, layer_kv) if config.kv_lora_rank is not None else Attention(config, layer_kv)
        self.sparse = is_sparse_layer(config, layer_kv.index)  # Qwen3-MoE: SparseMoE or the dense MLP
        self.mlp = SparseMoE(config) if self.sparse else SwiGLU(
            config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias)
        norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, config.rms_norm_unit_offset)  # noqa: E731
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()  # the norm before the MLP (Gemma's pre_feedforward_layernorm)
        # Gemma 2/3 also normalise each block's output before the residual add (use_post_norms).
        self.post_norms = config.use_post_norms
        if self.post_norms:
            self.post_attention_output_layernorm = norm()  # Gemma's post_attention_layernorm
            self.post_feedforward_layernorm = norm()

    def forward(self, x, cos, sin, mask, kv: KVState, router: RouterRecord | None = None):
        out = self.self_attn(self.input_layernorm(x), cos, sin, mask, kv)
        x = x + (self.post_attention_output_layernorm(out) if self.post_norms else out)
        if not self.sparse:
            out = self.mlp(self.post_attention_layernorm(x))
        else:
            out, logits = self.mlp(self.post_attention_layernorm(x))
            if router is not None:
                router.logits.append(logits)
        return x + (self.post_feedforward_layernorm(out) if self.post_norms else out)


class FusedKVPreTrainedModel(PreTrainedModel):
    config_class = FusedKVConfig
    config: FusedKVConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            hf_init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                hf_init.zeros_(module.bias)
            if isinstance(module, Router) and hasattr(module, "e_score_correction_bias"):
                hf_init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, nn.Embedding):
            hf_init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            (hf_init.zeros_ if module.unit_offset else hf_init.ones_)(module.weight)  # a gain of 1 either way
        elif isinstance(module, Experts):
            hf_init.normal_(module.gate_up_proj, mean=0.0, std=std)
            hf_init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, KVFusion):
            # transformers' generic init would leave these at whatever torch.empty held: the fusion
            # initialisation is the paper's Table 5 choice and must be applied explicitly.
            module.reset_parameters(self.config.fusion_init, _recurrence_depth(self.config.plan, module.layer),
                                    tuple(self.config.fusion_iterative_init), std)


def _recurrence_depth(plan, layer) -> int:
    """1 + the number of earlier reconstruction layers reading the same sources (the iterative chain)."""
    return 1 + sum(1 for other in plan.layers[: layer.index] if not other.stores and other.k_sources == layer.k_sources)


class FusedKVModel(FusedKVPreTrainedModel):
    def __init__(self, config: FusedKVConfig):
        super().__init__(config)
        self.plan = config.plan
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(config, layer_kv) for layer_kv in self.plan.layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.rms_norm_unit_offset)
        # One RoPE for every layer, or one per attention type (Gemma 3's local base); dynamic NTK recomputes
        # its frequencies from the positions of each forward, as transformers does.
        self.rope_types = tuple(rope_parameters_by_type(config))
        self.rope_keys = [t.attention_type if t.attention_type in self.rope_types else self.rope_types[0]
                          for t in self.plan.layers]
        self.dynamic_rope = any(p.get("rope_type") == "dynamic" for p in rope_parameters_by_type(config).values())
        # The iterative variant (paper App. A.3): each layer's fusion continues the previous one's recurrence.
        link_iterative_chains((d.self_attn.fusion for d in self.layers if not d.self_attn.layer.stores),
                              config.fusion_init)
        self.gradient_checkpointing = False
        self.post_init()

    def _apply(self, fn, recurse=True):
        # Moving or casting the model invalidates what the runtime chose for its old device and dtype
        # (`fusedkv.engine.select_runtime`): every seam goes back to the model's own.
        result = super()._apply(fn, recurse)
        for module in self.modules():
            if isinstance(module, (Attention, MLA)):  # the reference implementation
                module.use(None)
            if isinstance(module, Attention):
                module.fused_qk_rope = False
            if isinstance(module, Experts):  # the per-expert loop
                module.grouped = False
        return result

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        keep_last: int = 0,
        output_hidden_states: bool | None = None,
        past_key_values=None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if past_key_values is not None and cache is None:
            cache = past_key_values  # transformers-4 name
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            x = self.embed_tokens(input_ids)
            if self.config.embedding_multiplier != 1.0:  # Gemma: sqrt(hidden_size) rounded to the dtype first
                x = x * torch.tensor(float(self.config.embedding_multiplier)).to(x.dtype)
        else:
            x = inputs_embeds
        batch, q_len = x.shape[:2]
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None and not self.training:
            cache = DynamicCache(config=self.config)
        past = cache.get_seq_length() if cache is not None else 0
        if past + q_len > self.config.max_position_embeddings and not self.dynamic_rope:
            raise ValueError(
                f"the input is {past + q_len} tokens long ({past} cached + {q_len} new) but the model's "
                f"max_position_embeddings is {self.config.max_position_embeddings}; shorten the prompt or the "
                "number of new tokens, or continue training at a longer context"
            )

        skip_from = self.plan.first_skippable_layer
        if not (0 < keep_last < q_len) or output_hidden_states:
            skip_from = len(self.layers)
        causal = attention_mask is None and past == 0 and q_len > 1
        if causal and (skip_from == len(self.layers) or keep_last == 1):
            mask = None  # SDPA's causal flag; the skipped last row attends to every key anyway
            position_ids = _default_positions(position_ids, batch, past, q_len, x.device)
        else:
            causal = False
            mask, position_ids = _mask_and_positions(attention_mask, position_ids, batch, past, q_len, x.device)
        rope = self._rope_tables(position_ids, x.dtype)
        kv = KVState(cache=cache, causal=causal, padding_mask=attention_mask)
        if self.config.sliding_window and SLIDING in self.config.layer_types:
            kv.window_mask = _window_mask(mask, causal, past, q_len, self.config.sliding_window, x.device)
        router = RouterRecord() if self.config.num_experts > 0 else None
        hidden_states = (x,) if output_hidden_states else None
        for i, layer in enumerate(self.layers):
            if i == skip_from:
                x = x[:, -keep_last:]
                rope = {t: (c[:, :, -keep_last:], s[:, :, -keep_last:]) for t, (c, s) in rope.items()}
                mask = mask[:, :, -keep_last:] if mask is not None else None
                if kv.window_mask is not None:
                    kv.window_mask = kv.window_mask[:, :, -keep_last:]
                kv.causal = False  # only the last row(s) remain
            cos, sin = rope[self.rope_keys[i]]
            if self.gradient_checkpointing and self.training:
                x = self._gradient_checkpointing_func(layer.__call__, x, cos, sin, mask, kv, router)
            else:
                x = layer(x, cos, sin, mask, kv, router)
            if output_hidden_states:
                hidden_states += (x,)
        x = self.norm(x)
        if output_hidden_states:  # transformers' convention: the last entry is the normed output
            hidden_states = hidden_states[:-1] + (x,)
        if router is not None:
            return MoeModelOutputWithPast(last_hidden_state=x, cache=cache if use_cache else None,
                                          hidden_states=hidden_states, router_logits=tuple(router.logits))
        return BaseModelOutputWithPast(last_hidden_state=x, cache=cache if use_cache else None,
                                       hidden_states=hidden_states)


    def _rope_tables(self, position_ids: torch.Tensor, dtype: torch.dtype) -> dict:
        """{attention type (None: all layers): (cos, sin)} for these positions."""
        seq_len = int(position_ids.max()) + 1 if self.dynamic_rope else None
        tables = {}
        for layer_type in self.rope_types:
            inv_freq, scaling = rope_inv_freq(self.config, layer_type, seq_len)
            tables[layer_type] = rope_tables(position_ids, inv_freq, dtype, scaling)
        return tables


def _window_mask(mask, causal, past, q_len, window, device):
    """The mask of sliding-window layers (Qwen3 / Mistral semantics, paper App. A.6): a query at
    position p sees keys p - W < k <= p, on top of the padding mask (or the causal pattern the flag
    stands for). None when no key can fall outside the window."""
    total = past + q_len
    if mask is None and not causal and total <= window:
        return None
    q_pos = torch.arange(past, total, device=device)[:, None]
    k_pos = torch.arange(total, device=device)[None, :]
    band = ((q_pos - k_pos < window) & (k_pos <= q_pos))[None, None]
    return band if mask is None else mask & band


def _default_positions(position_ids, batch, past, q_len, device):
    if position_ids is not None:
        return position_ids
    return torch.arange(past, past + q_len, device=device).unsqueeze(0).expand(batch, q_len)


def _mask_and_positions(attention_mask, position_ids, batch, past, q_len, device):
    """Boolean attention mask [B, 1, T, past+T] (True = attend; None when nothing is masked) and RoPE
    positions [B, T]. With a 2-D padding mask, positions count real tokens only, so a left-padded
    sequence gets the same positions as the unpadded one."""
    total = past + q_len
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape != (batch, total):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}; expected [batch, cached + new tokens] = "
                f"[{batch}, {total}]"
            )
        valid = attention_mask.bool()
        if position_ids is None:
            position_ids = (valid.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
    position_ids = _default_positions(position_ids, batch, past, q_len, device)
    if attention_mask is None and q_len == 1:
        return None, position_ids
    q_pos = torch.arange(past, total, device=device)
    mask = torch.arange(total, device=device)[None, :] <= q_pos[:, None]  # [T, S] causal
    mask = mask[None, None]
    if attention_mask is not None:
        # A left-pad query row would attend to nothing (NaN in SDPA, and NaN values then leak into real
        # rows through 0 * NaN). Letting every row see its own position keeps pad rows finite and
        # changes no real row, which always sees itself.
        diagonal = torch.arange(total, device=device)[None, :] == q_pos[:, None]
        mask = (mask & valid[:, None, None, :]) | diagonal[None, None]
    return mask, position_ids


def _contiguous_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with every tensor contiguous and unshared, as safetensors needs, even after
    `pack_for_decode` made weights column-major views of one buffer. Tied weights (one tensor under
    two names) stay one tensor, so transformers still recognises the tie."""
    copies: dict[int, torch.Tensor] = {}
    return {k: copies.setdefault(id(v), v.contiguous()) for k, v in model.state_dict().items()}


class FusedKVForCausalLM(FusedKVPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: FusedKVConfig):
        super().__init__(config)
        self.model = FusedKVModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @property
    def plan(self):
        return self.model.plan

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save as usual, plus a two-line module and `auto_map` so that tools which never `import fusedkv`
        (lm-eval's CLI, plain transformers) load the checkpoint with `trust_remote_code=True`, as long as
        the fusedkv package is installed."""
        from pathlib import Path

        self.config.auto_map = {"AutoConfig": "fusedkv_remote.FusedKVConfig",
                                "AutoModel": "fusedkv_remote.FusedKVModel",
                                "AutoModelForCausalLM": "fusedkv_remote.FusedKVForCausalLM"}
        if kwargs.get("state_dict") is None:
            kwargs["state_dict"] = _contiguous_state_dict(self)
        super().save_pretrained(save_directory, *args, **kwargs)
        Path(save_directory, "fusedkv_remote.py").write_text(
            '"""Lets transformers load this checkpoint with trust_remote_code=True when fusedkv is installed."""\n'
            "from fusedkv import FusedKVConfig, FusedKVForCausalLM, FusedKVModel  # noqa: F401\n")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        from ..model_dirs import check_checkpoint_dir

        check_checkpoint_dir(pretrained_model_name_or_path, kwargs.get("config"))
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_hidden_states: bool | None = None,
        past_key_values=None,
        output_router_logits: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        keep_last = logits_to_keep if isinstance(logits_to_keep, int) and labels is None else 0
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            inputs_embeds=inputs_embeds, use_cache=use_cache, keep_last=keep_last,
            output_hidden_states=output_hidden_states, past_key_values=past_key_values,
        )
        h = out.last_hidden_state
        if isinstance(logits_to_keep, int):
            h = h[:, -logits_to_keep:] if logits_to_keep > 0 else h
        else:
            h = h[:, logits_to_keep]
        logits = self.lm_head(h)
        cap = self.config.final_logit_softcapping
        if cap:  # Gemma 2/3
            logits = torch.tanh(logits / cap) * cap
        loss = None
        if labels is not None:
            # transformers convention: labels are the input ids; the shift happens here.
            loss = lm_loss(logits, shift_labels(labels))
        if self.config.num_experts > 0:
            return self._moe_output(out, loss, logits, attention_mask, output_router_logits)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=out.cache,
                                      hidden_states=out.hidden_states)

    def _moe_output(self, out, loss, logits, attention_mask, output_router_logits):
        """Qwen3-MoE's output: the load-balancing loss (computed when asked for and always in training,
        so the training loss carries it) and, with labels, the LM loss plus router_aux_loss_coef * aux."""
        want = self.config.output_router_logits if output_router_logits is None else output_router_logits
        aux_loss = None
        if (want or self.training) and out.router_logits:
            batch = logits.shape[0]
            # Each layer routed its own rows (prefill skipping keeps fewer); padding rows do not count.
            masks = [None if attention_mask is None else attention_mask[:, -(r.shape[0] // batch):].reshape(-1)
                     for r in out.router_logits]
            aux_loss = load_balancing_loss(list(out.router_logits), self.config.num_experts_per_tok, masks)
            if loss is not None:
                loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=logits, cache=out.cache,
                                         hidden_states=out.hidden_states,
                                         router_logits=out.router_logits if want else None)
