"""Sparse MoE MLP: grouped dispatch equals a plain per-expert loop, the load-balancing loss equals its
definition and transformers' function, decode equals the full forward under every plan, bad configs
are refused."""

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from fusedkv.model.moe import SparseMoE, load_balancing_loss
from fusedkv.train import compute_loss
from tests.conftest import PLAN_CONFIGS, tiny_config, tiny_model
from tests.model.test_decode import incremental_logits, padded_batch

MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24)


def naive_moe(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Reference: for every expert, the tokens whose top-k contains it, straight from the definition."""
    probs = torch.softmax(block.gate(x).double(), -1)
    top_w, top_e = probs.topk(block.top_k, -1)
    if block.norm_topk_prob:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    out = torch.zeros_like(x, dtype=torch.float64)
    ex = block.experts
    for e in range(ex.num_experts):
        tok, slot = (top_e == e).nonzero(as_tuple=True)
        w_gate, w_up = ex.gate_up_proj[e].double().chunk(2, dim=0)
        h = x[tok].double()
        y = (torch.nn.functional.silu(h @ w_gate.T) * (h @ w_up.T)) @ ex.down_proj[e].double().T
        out.index_add_(0, tok, y * top_w[tok, slot, None])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # grouped GEMM, per-expert matmuls
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_grouped_dispatch_matches_per_expert_loop(dtype, norm_topk_prob):
    torch.manual_seed(0)
    block = SparseMoE(tiny_config(**MOE, norm_topk_prob=norm_topk_prob)).to(dtype)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 37, 64, dtype=dtype)
    out, logits = block(x)
    assert logits.shape == (74, 6)
    ref = naive_moe(block, x.flatten(0, 1)).view_as(x)
    assert (out.double() - ref).abs().max() < (1e-5 if dtype == torch.float32 else 1e-12)


def test_grouped_dispatch_gradients_match_reference():
    torch.manual_seed(1)
    block = SparseMoE(tiny_config(**MOE))
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(40, 64)
    upstream = torch.randn(40, 64)
    (block(x)[0] * upstream).sum().backward()
    grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    (naive_moe(block, x).float() * upstream).sum().backward()
    for g, p in zip(grads, block.parameters()):
        assert (g - p.grad).abs().max() < 1e-4


def test_aux_loss_equals_definition_and_transformers():
    torch.manual_seed(2)
    e, k = 5, 2
    layers = [torch.randn(12, e), torch.randn(12, e), torch.randn(12, e)]
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    rows = mask.flatten().float()
    # Definition (Switch Transformer eq. 4-6, pooled over layers): E * sum_e f_e P_e over real tokens.
    f, p = torch.zeros(e), torch.zeros(e)
    for logits in layers:
        probs = logits.softmax(-1)
        for t in range(12):
            if rows[t]:
                for j in probs[t].topk(k).indices:
                    f[j] += 1
                p += probs[t]
    n = rows.sum() * len(layers)
    direct = e * ((f / n) * (p / n)).sum()
    ours = load_balancing_loss(layers, k, [rows] * 3)
    assert torch.allclose(ours, direct, atol=1e-6)
    assert torch.allclose(ours, load_balancing_loss_func(tuple(layers), e, k, mask), atol=1e-6)
    assert torch.allclose(load_balancing_loss(layers, k, [None] * 3), load_balancing_loss_func(tuple(layers), e, k))
    uniform = [torch.zeros(10, 4)]  # P_e = 1/E and sum_e f_e = k, so aux = E * k / E = k
    assert torch.allclose(load_balancing_loss(uniform, 2, [None]), torch.tensor(2.0))


def test_model_loss_adds_weighted_aux_loss_and_trainer_uses_it():
    model = tiny_model("fusedkv", **MOE, router_aux_loss_coef=0.5)
    ids = torch.randint(1, 97, (2, 16))
    model.train()
    out = model(ids, labels=ids, use_cache=False)
    lm = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert len(out.router_logits or ()) == 0  # only returned when output_router_logits asks for them
    assert torch.allclose(out.loss, lm + 0.5 * out.aux_loss)
    direct = load_balancing_loss(_router_logits(model, ids), 2, [None] * 4)
    assert torch.allclose(out.aux_loss, direct, atol=1e-6)
    # The trainer's loss (labels pre-shifted) carries the aux term in training mode only.
    x, y = ids[:, :-1], ids[:, 1:]
    train_loss = compute_loss(model, x, y)
    plain = torch.nn.functional.cross_entropy(model(x, use_cache=False).logits.flatten(0, 1), y.flatten())
    assert train_loss > plain + 0.4  # 0.5 * aux, and aux >= 1 (its minimum is reached at uniform routing)
    model.eval()
    assert model(x, use_cache=False).aux_loss is None
    assert torch.allclose(compute_loss(model, x, y), plain)
    out = model(x, use_cache=False, output_router_logits=True)
    assert len(out.router_logits) == 4 and out.aux_loss is not None


def _router_logits(model, ids):
    return list(model(ids, use_cache=False, output_router_logits=True).router_logits)


def test_sparse_layer_selection_follows_qwen3_moe():
    model = tiny_model("fusedkv", **MOE, decoder_sparse_step=2, mlp_only_layers=[3])
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["SwiGLU", "SparseMoE", "SwiGLU", "SwiGLU"]


@pytest.mark.parametrize("plan", list(PLAN_CONFIGS))
def test_moe_incremental_decode_matches_full_forward(plan):
    model = tiny_model(plan, **MOE)
    ids, mask, width = padded_batch(9)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        steps, _ = incremental_logits(model, ids, mask, width)
        skipped, _ = incremental_logits(model, ids, mask, width, keep_last=1)
    valid = mask[:, :width].bool()
    assert (steps[0] - full[:, :width])[valid].abs().max() < 1e-4
    assert (skipped[0][:, 0] - full[:, width - 1]).abs().max() < 1e-4
    for k, (step, skip) in enumerate(zip(steps[1:], skipped[1:])):
        assert (step[:, 0] - full[:, width + k]).abs().max() < 1e-4
        assert (skip[:, 0] - full[:, width + k]).abs().max() < 1e-4


def test_moe_checkpoint_roundtrip(tmp_path):
    from fusedkv import FusedKVForCausalLM

    model = tiny_model("fusedkv", **MOE)
    model.save_pretrained(tmp_path)
    loaded = FusedKVForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(1, 97, (1, 10))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


@pytest.mark.parametrize("overrides, match", [
    (dict(num_experts=4, num_experts_per_tok=5), "num_experts_per_tok=5"),
    (dict(num_experts=4, num_experts_per_tok=0), "num_experts_per_tok=0"),
    (dict(num_experts=-1), "num_experts=-1"),
    (dict(num_experts=4, num_experts_per_tok=2, mlp_only_layers=[4]), "mlp_only_layers"),
    (dict(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=0), "decoder_sparse_step=0"),
])
def test_bad_moe_configs_are_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**overrides)


@pytest.mark.parametrize("overrides, match", [
    (dict(topk_method="top2"), "topk_method='top2'"),
    (dict(topk_method="noaux_tc"), "set n_group and topk_group"),
    (dict(topk_method="group_limited_greedy", n_group=5, topk_group=1), "n_group=5"),
    (dict(topk_method="group_limited_greedy", n_group=4, topk_group=5), "topk_group=5"),
    (dict(topk_method="group_limited_greedy", n_group=4, topk_group=1, num_experts_per_tok=3), "num_experts_per_tok=3"),
    (dict(topk_method="noaux_tc", n_group=8, topk_group=2), "top-2"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
    (dict(n_shared_experts=-1), "n_shared_experts"),
    (dict(rope_interleave=True), "rope_interleave applies to MLA"),
])
def test_bad_deepseek_routing_configs_are_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**{**MOE, "num_experts": 8, **overrides})
