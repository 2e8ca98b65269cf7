"""Mixture-of-experts MLPs of FusedKV models served by vLLM (Qwen3-MoE and DeepSeekMoE routing).

KV sharing touches attention only (paper App. A.6), so a sparse layer's MLP is the model's own
`fusedkv.model.moe.SparseMoE`: its router (softmax or DeepSeek-V3's sigmoid with
`e_score_correction_bias`, grouped top-k, `norm_topk_prob`, `routed_scaling_factor`), its grouped
expert GEMM and its shared experts, with the checkpoint's parameter names. It is transformers'
arithmetic step for step (`fusedkv.model.moe`), so float32 greedy tokens equal transformers' and
`fusedkv generate`'s (tests/serving/test_vllm_moe_mla.py). vLLM's `FusedMoE` is not used yet: its CPU
router (vLLM 0.32 `fused_moe/router/cpu_router.py`) does express this routing (softmax or sigmoid scores,
e_score_correction_bias, grouped top-k, renormalisation, routed_scaling_factor on the weights), but its
experts run in its own fused CPU kernel with another summation order, and wiring it (expert weight
mapping, shared experts beside it) was not tried against the exactness bar.

Under torch.compile the layer runs as one opaque custom op (`torch.ops.vllm.fusedkv_moe`), as
vLLM's own MoE layers do: the routing has data-dependent shapes (tokens per expert) that the graph
must not trace. The op finds its layer by name in vLLM's forward context.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.utils.torch_utils import direct_register_custom_op

from ..model.moe import SparseMoE, is_sparse_layer


class ServedMoE(SparseMoE):
    """One sparse MLP: `forward(hidden_states [T, H]) -> [T, H]` (the router logits are not needed).
    Its parameters are SparseMoE's, named as in the checkpoint (`mlp.gate.weight`, `mlp.experts.*`)."""

    def __init__(self, config, prefix: str):
        super().__init__(config)
        self.layer_name = prefix
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate layer name {prefix!r}")
        context[prefix] = self

    def run(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden_states)[0]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.ops.vllm.fusedkv_moe(hidden_states, self.layer_name)


def _moe(hidden_states: torch.Tensor, layer_name: str) -> torch.Tensor:
    return get_forward_context().no_compile_layers[layer_name].run(hidden_states)


def _moe_fake(hidden_states: torch.Tensor, layer_name: str) -> torch.Tensor:
    return torch.empty_like(hidden_states)


direct_register_custom_op(op_name="fusedkv_moe", op_func=_moe, fake_impl=_moe_fake)


def make_moe_mlp(config, index: int, prefix: str) -> nn.Module | None:
    """The sparse MLP of layer `index`, or None where the layer keeps the dense MLP (Qwen3-MoE's
    `mlp_only_layers` / `decoder_sparse_step`, DeepSeek's first_k_dense_replace)."""
    return ServedMoE(config, prefix) if is_sparse_layer(config, index) else None
