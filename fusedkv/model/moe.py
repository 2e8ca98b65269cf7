"""Sparse mixture-of-experts MLP (Qwen3-MoE semantics) and its load-balancing loss.

The paper stacks FusedKV on MoE models (App. A.6): KV sharing only touches attention, so the MLP of
every layer, storage or reconstruction, may be sparse. Names and arithmetic follow transformers'
`Qwen3MoeSparseMoeBlock`, so Qwen3-MoE checkpoints convert with identical logits:

    p = softmax(W_gate x)            top-k of p (renormalised to sum 1 when `norm_topk_prob`)
    y = sum_{e in top-k} p_e * down_e(silu(gate_e x) * up_e x)

DeepSeekMoE (DeepSeek-V2/V3, as transformers' `DeepseekV2Moe` / `DeepseekV3MoE` compute it) adds, by config:
always-on shared experts summed with the routed output (`n_shared_experts`); routing restricted to the
`topk_group` best of `n_group` expert groups (`topk_method` "group_limited_greedy": V2's softmax, groups
ranked by their best expert; "noaux_tc": V3's sigmoid scores, experts chosen on scores plus the router's
`e_score_correction_bias`, groups ranked by their two best, weights the unbiased scores); and
`routed_scaling_factor` on the routed weights (after the `norm_topk_prob` renormalisation).

Experts are stored as transformers keeps them in memory: `experts.gate_up_proj` [E, 2I, H] (gate
rows first) and `experts.down_proj` [E, H, I], one 3-D tensor each, so every expert's weights sit in
one buffer a grouped GEMM can index.

Dispatch is grouped, never per token: the (token, slot) pairs are sorted by expert, so each expert's
tokens form one contiguous block; one grouped matrix product (`torch.nn.functional.grouped_mm`, which
takes the block offsets) runs every expert over its own block, and the weighted results are added
back to their tokens with one `index_add_`, where the runtime selected it (`Experts.grouped`, set by
`fusedkv.engine.select_runtime` where `grouped_mm` takes the device and dtype); the model's own form, and
the one everywhere else (fp64, the tests' reference precision; fp32 on CUDA), runs the same sorted blocks
one matmul per expert.

The load-balancing loss is the Switch Transformer auxiliary loss exactly as transformers computes it
for Qwen3-MoE (`load_balancing_loss_func`): with f_e the fraction of top-k assignments that went to
expert e and P_e the mean router probability of e, both pooled over every sparse layer's tokens,
aux = E * sum_e f_e * P_e (equal to k when routing is perfectly uniform).
Whatever the routing it is this softmax loss; transformers' DeepSeek classes add none, so DeepSeek imports
set `router_aux_loss_coef` to 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import SwiGLU


def is_sparse_layer(config, index: int) -> bool:
    """Qwen3-MoE's rule for which decoder layers (0-based) get the sparse MLP."""
    return (config.num_experts > 0 and index not in (config.mlp_only_layers or [])
            and (index + 1) % config.decoder_sparse_step == 0)


class Experts(nn.Module):
    """E SwiGLU experts in two 3-D tensors; `forward` runs each expert over its own block of rows."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # The runtime's seam (`fusedkv.engine.select_runtime` sets it, once, where torch's grouped GEMM takes
        # the model's device and dtype): one grouped product over every expert. Off, one matmul per expert.
        self.grouped = False

    def forward(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x_sorted: [N, H] rows grouped by expert (expert 0's rows first); counts: [E] rows per expert."""
        if self.grouped:
            offsets = counts.cumsum(0).to(torch.int32)
            h = F.grouped_mm(x_sorted, self.gate_up_proj.transpose(1, 2), offs=offsets)
            gate, up = h.chunk(2, dim=-1)
            return F.grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=offsets)
        out = []
        for e, rows in enumerate(x_sorted.split(counts.tolist())):
            gate, up = F.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)
            out.append(F.linear(F.silu(gate) * up, self.down_proj[e]))
        return torch.cat(out)


class Router(nn.Linear):
    """The gate: a bias-free [E, H] linear (`gate.weight`). With topk_method "noaux_tc" (DeepSeek-V3) also
    the per-expert `e_score_correction_bias` added to the scores when choosing experts, never to their
    weights: a buffer, since DeepSeek-V3 adjusts it between steps by expert load, not by gradient."""

    def __init__(self, config):
        super().__init__(config.hidden_size, config.num_experts, bias=False)
        if config.topk_method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))


class SparseMoE(nn.Module):
    """Router (`gate`) + routed experts (+ DeepSeekMoE's always-on `shared_experts`, one SwiGLU of
    n_shared_experts * moe_intermediate_size channels); returns (output, router logits [N, E])."""

    def __init__(self, config):
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.topk_method, self.routed_scaling_factor = config.topk_method, config.routed_scaling_factor
        self.n_group, self.topk_group = config.n_group or 1, config.topk_group or 1
        self.gate = Router(config)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_experts = (SwiGLU(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
                               if config.n_shared_experts else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [N, H] -> (router logits [N, E], top-k weights [N, k] in x's dtype, top-k experts [N, k])."""
        logits = self.gate(x)
        # fp32 routing as Qwen3-MoE and DeepSeek do for bf16/fp32 (fp64 stays fp64 for reference checks).
        dtype = torch.promote_types(logits.dtype, torch.float32)
        if self.topk_method == "noaux_tc":  # DeepSeek-V3: sigmoid scores, biased choice, unbiased weights
            scores = torch.sigmoid(logits.to(dtype))
            choice = self._within_groups(scores + self.gate.e_score_correction_bias.to(dtype), float("-inf"),
                                         lambda g: g.topk(2, dim=-1).values.sum(dim=-1))
            experts = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
            weights = scores.gather(1, experts)
            if self.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            probs = torch.softmax(logits, dim=-1, dtype=dtype)
            if self.topk_method == "group_limited_greedy":  # DeepSeek-V2: groups ranked by their best expert
                probs = self._within_groups(probs, 0.0, lambda g: g.max(dim=-1).values)
            weights, experts = torch.topk(probs, self.top_k, dim=-1)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return logits, weights.to(x.dtype), experts

    def _within_groups(self, scores: torch.Tensor, fill: float, group_score) -> torch.Tensor:
        """`scores` [N, E] with every expert outside the topk_group best of the n_group groups (ranked by
        `group_score` over each group's [N, G, E/G] scores) set to `fill`."""
        if self.n_group == 1:
            return scores
        grouped = scores.view(scores.shape[0], self.n_group, -1)
        best = torch.topk(group_score(grouped), self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], fill).view_as(scores)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits, weights, experts = self.route(x)
        # Sort the N*k (token, slot) assignments by expert: each expert's rows become one block.
        flat_experts = experts.flatten()
        order = flat_experts.argsort(stable=True)
        token = order // self.top_k
        counts = torch.bincount(flat_experts, minlength=self.experts.num_experts)
        y = self.experts(x[token], counts) * weights.flatten()[order, None]
        out = torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape), logits


class RouterRecord:
    """The router logits of every sparse layer in one forward, for the load-balancing loss.

    A plain class on purpose (like `KVState`): wrappers such as FSDP2 rebuild lists and dataclasses among
    a module's arguments, and every layer must append to this one object."""

    __slots__ = ("logits",)

    def __init__(self):
        self.logits: list[torch.Tensor] = []


def load_balancing_loss(router_logits: list[torch.Tensor], top_k: int, row_masks: list[torch.Tensor | None]):
    """Switch Transformer load-balancing loss over every sparse layer, as transformers' Qwen3-MoE computes
    it. router_logits[l]: [N_l, E]; row_masks[l]: [N_l] (1 = real token, 0 = padding) or None."""
    num_experts = router_logits[0].shape[-1]
    assigned = torch.zeros(num_experts, dtype=torch.float32, device=router_logits[0].device)
    prob_sum = torch.zeros_like(assigned)
    rows = 0.0
    for logits, mask in zip(router_logits, row_masks):
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        mask = torch.ones(probs.shape[0], device=probs.device) if mask is None else mask.float()
        # Counting assignments does not depend on the weights: no gradient flows through f_e (as in Switch).
        assigned = assigned.scatter_add(0, chosen.flatten(), mask.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs * mask[:, None]).sum(0)
        rows = rows + mask.sum()
    return num_experts * torch.sum((assigned / rows) * (prob_sum / rows))


__all__ = ["Experts", "Router", "RouterRecord", "SparseMoE", "is_sparse_layer", "load_balancing_loss"]
