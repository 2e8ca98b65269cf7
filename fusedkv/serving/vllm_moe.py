"""Mixture-of-experts MLPs of FusedKV models served by vLLM (Qwen3-MoE and DeepSeekMoE routing).

KV sharing touches attention only (paper App. A.6), so a sparse layer's MLP is an ordinary MoE. Two ways to
run it, chosen once when the model is built (`choose_moe_path`, logged once):

  * "fused" (the default): vLLM's own `FusedMoE` (`FusedMoEFactory`, as vLLM's qwen3_moe.py and
    deepseek_v2.py build it). The router is vLLM's (on CPU `fused_moe/router/cpu_router.py`), configured
    from our config: Qwen3-MoE's softmax top-k with `norm_topk_prob` (renormalize); DeepSeek-V2's grouped
    top-k ("group_limited_greedy": softmax, groups ranked by their best expert); DeepSeek-V3's "noaux_tc"
    (sigmoid scores, `e_score_correction_bias` in the choice only, groups ranked by their top-2 sum);
    `routed_scaling_factor` on the routed weights (after renormalisation, as ours). The experts run in vLLM's
    fused kernel (on CPU `cpu_fused_moe`); DeepSeekMoE's shared experts are a gated MLP beside it, added by
    vLLM's MoE runner as in its DeepSeek model. The checkpoint's stacked expert tensors
    (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first, and `mlp.experts.down_proj` [E, H, I]) load
    through vLLM's own expert mapping (`RoutedExperts.load_weights`, the fused-checkpoint entries of
    `make_expert_params_mapping`). Same math as ours, another summation order: float32 prompt
    log-probabilities agree to ~1e-6 (tests/serving/test_vllm_fused_moe.py).
  * "exact": the model's own `fusedkv.model.moe.SparseMoE` (transformers' arithmetic step for step, so
    float32 greedy tokens equal `fusedkv generate`'s and transformers'), run under torch.compile as one
    opaque custom op (`torch.ops.vllm.fusedkv_moe`) so the graph does not trace its data-dependent expert
    blocks; the op finds its layer by name in vLLM's forward context. Chosen by `FUSEDKV_VLLM_MOE=exact` (the
    variable is read by `plugin.requested_moe_path`, which `fusedkv serve` checks before vLLM starts), and
    where vLLM's FusedMoE cannot run the config: on CPU, a hidden size that is not a multiple of the fused
    kernel's output alignment (32 in vLLM 0.32's `CPUUnquantizedExperts`). Every routing the config admits
    (`FusedKVConfig._check_routing`) is expressible by vLLM's router, so nothing else falls back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory
from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
from vllm.platforms import current_platform
from vllm.utils.torch_utils import direct_register_custom_op

from ..model.moe import SparseMoE, is_sparse_layer
from .plugin import MOE_ENV, MOE_PATHS, requested_moe_path

# Under "vllm.": vLLM configures handlers for its own logger tree only, so a plain module name would print nothing.
logger = init_logger(f"vllm.{__name__}")

FUSED, EXACT = MOE_PATHS


def moe_path(config) -> tuple[str, str]:
    """(FUSED or EXACT, why): how this model's sparse layers run, from `FUSEDKV_VLLM_MOE` and the config."""
    if requested_moe_path() == EXACT:
        return EXACT, f"{MOE_ENV}={EXACT}"
    if current_platform.is_cpu():
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

        align = CPUUnquantizedExperts.output_alignment
        if config.hidden_size % align:
            return EXACT, (f"hidden_size={config.hidden_size} is not a multiple of {align}, which vLLM's CPU fused-MoE "
                           "kernel needs")
    return FUSED, "vLLM's FusedMoE"


class FusedSparseMoE(nn.Module):
    """One sparse MLP on vLLM's FusedMoE: `forward(hidden_states [T, H]) -> [T, H]`. Parameters: `gate.weight`
    (+ `gate.e_score_correction_bias` for "noaux_tc"), `shared_experts.*` (vLLM's stacked gate_up_proj), and
    `experts.routed_experts.w13_weight` / `w2_weight` (vLLM's layout, filled by `load_experts`)."""

    def __init__(self, config, prefix: str, shared_mlp: Callable[[int, str], nn.Module]):
        super().__init__()
        noaux = config.topk_method == "noaux_tc"
        self.gate = GateLinear(config.hidden_size, config.num_experts, prefix=f"{prefix}.gate")
        # A parameter, as vLLM's DeepSeek model keeps it (fp32); the router reads this very tensor.
        self.gate.e_score_correction_bias = (
            nn.Parameter(torch.empty(config.num_experts, dtype=torch.float32), requires_grad=False) if noaux else None)
        self.shared_experts = (shared_mlp(config.moe_intermediate_size * config.n_shared_experts,
                                          f"{prefix}.shared_experts") if config.n_shared_experts else None)
        # vLLM's plain softmax top-k has no scaling factor: any other routing goes through its grouped top-k
        # (one group of all experts for "greedy", as vLLM's DeepSeek model does).
        grouped = config.topk_method != "greedy" or config.routed_scaling_factor != 1.0
        groups = (config.n_group, config.topk_group) if config.topk_method != "greedy" else (1, 1)
        self.experts = FusedMoEFactory(
            num_experts=config.num_experts, top_k=config.num_experts_per_tok, hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size, renormalize=config.norm_topk_prob,
            use_grouped_topk=grouped, num_expert_group=groups[0] if grouped else None,
            topk_group=groups[1] if grouped else None, scoring_func="sigmoid" if noaux else "softmax",
            routed_scaling_factor=config.routed_scaling_factor,
            e_score_correction_bias=self.gate.e_score_correction_bias,
            gate=self.gate, shared_experts=self.shared_experts, prefix=f"{prefix}.experts")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # The runner holds the gate: it computes the router logits itself from the hidden states.
        return self.experts(hidden_states=hidden_states, router_logits=hidden_states)

    def load_experts(self, name: str, tensor: torch.Tensor) -> list[str]:
        """Load the checkpoint tensor `experts.<name>` (all experts stacked); returns the parameter names filled,
        relative to this module."""
        filled = sorted(set(self.experts.load_weights([(name, tensor)])))
        if not filled:
            raise ValueError(f"checkpoint tensor 'experts.{name}' {tuple(tensor.shape)} does not map onto "
                             "vLLM's FusedMoE experts (expected experts.gate_up_proj [E, 2I, H] or "
                             "experts.down_proj [E, H, I])")
        return [f"experts.{n}" for n in filled]


class ServedMoE(SparseMoE):
    """The exact path: the model's own SparseMoE, `forward(hidden_states [T, H]) -> [T, H]` through one custom
    op (the router logits are not needed). Its parameters are SparseMoE's, named as in the checkpoint."""

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


def choose_moe_path(config) -> str | None:
    """FUSED or EXACT for a model with sparse layers (None without): decided and logged once per model,
    before its layers are built."""
    if config.num_experts <= 0:
        return None
    path, why = moe_path(config)
    # A warning where the fused path was asked for (the default) but cannot run this config.
    fallback = path == EXACT and requested_moe_path() == FUSED
    say = logger.warning_once if fallback else logger.info_once
    say(f"fusedkv: sparse MoE layers run on the {path} path ({why})")
    return path


def make_moe_mlp(config, index: int, prefix: str, shared_mlp: Callable[[int, str], nn.Module],
                 path: str | None) -> nn.Module | None:
    """The sparse MLP of layer `index` on `path` (`choose_moe_path`), or None where the layer keeps the dense
    MLP (Qwen3-MoE's `mlp_only_layers` / `decoder_sparse_step`, DeepSeek's first_k_dense_replace).
    `shared_mlp(size, prefix)` builds DeepSeekMoE's shared experts (the served gated MLP) for the fused path."""
    if path is None or not is_sparse_layer(config, index):
        return None
    return FusedSparseMoE(config, prefix, shared_mlp) if path == FUSED else ServedMoE(config, prefix)
