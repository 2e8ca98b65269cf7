"""Calibrated conversion on tiny models: a teacher whose upper K/V are an exact channel-wise fusion of its
storage layers' is recovered to float64 precision (weights, sources, logits); on a random teacher the
layer refits lower the errors they fit; RoPE pairs stay tied; a custom source map decodes as it forwards."""

from __future__ import annotations

import copy

import pytest
import torch

from fusedkv import FusedKVConfig, FusedKVForCausalLM
from fusedkv.calibrate import fit_fusion, refit_layers, set_fusion, source_map
from fusedkv.convert import fusedkv_to_plan_config, model_from_state

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def _config(layers: int, **overrides) -> FusedKVConfig:
    return FusedKVConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=64, use_qk_norm=False, kv_sharing="vanilla", **overrides)


def _batches(n: int = 3, tokens: int = 24, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 61, (1, tokens), generator=gen) for _ in range(n)]


def _fusion_teacher(layers: int, sources: dict[int, tuple[int, int]], seed: int = 0):
    """A float64 vanilla teacher whose layers all see the embeddings (every attention and MLP output but the
    last layer's is zero), and whose layer i in `sources` projects K = a1 (.) K^s1 + a2 (.) K^s2 (keys tied
    over RoPE pairs) and V = b1 (.) V^s1 + b2 (.) V^s2 exactly. Returns (teacher, {i: (a [2, H, D/2], b)})."""
    torch.manual_seed(seed)
    teacher = FusedKVForCausalLM(_config(layers)).double().eval()
    weights = {}
    with torch.no_grad():
        for layer in teacher.model.layers[:-1]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        attn = [layer.self_attn for layer in teacher.model.layers]
        for i, (s1, s2) in sources.items():
            a = torch.rand(2, KV_HEADS, HEAD_DIM // 2, dtype=torch.float64) + 0.2
            b = torch.randn(2, KV_HEADS, HEAD_DIM, dtype=torch.float64)
            rows = lambda w: w.reshape(2, -1, 1)  # noqa: E731  [2, H*D] per-output-channel scales
            ak = rows(torch.cat((a, a), dim=-1))
            attn[i].k_proj.weight.copy_(ak[0] * attn[s1].k_proj.weight + ak[1] * attn[s2].k_proj.weight)
            bv = rows(b)
            attn[i].v_proj.weight.copy_(bv[0] * attn[s1].v_proj.weight + bv[1] * attn[s2].v_proj.weight)
            weights[i] = (a, b)
    return teacher, weights


def _student(teacher, plan: str, **overrides):
    config = fusedkv_to_plan_config(teacher.config.to_dict(), plan, **overrides)
    return model_from_state(teacher.state_dict(), config).double().eval()


def _logits(model, batches):
    with torch.no_grad():
        return torch.cat([model(ids, use_cache=False).logits for ids in batches])


def test_exact_fusion_recovered_to_float64_precision():
    teacher, weights = _fusion_teacher(4, {2: (0, 1), 3: (0, 1)})  # the paper's sources: layer 1 and n = 2
    batches = _batches()
    student = _student(teacher, "fusedkv")
    fits = fit_fusion(teacher, student.plan, batches)
    for fit in fits:
        a, b = weights[fit.index]
        assert fit.k_weight.permute(2, 0, 1) == pytest.approx(a, abs=1e-10)
        assert fit.v_weight.permute(2, 0, 1) == pytest.approx(b, abs=1e-10)
        assert fit.errors["k_residual"] < 1e-12 and fit.errors["v_residual"] < 1e-12
    before = _logits(student, batches)
    set_fusion(student, fits)
    for layer in student.model.layers[2:]:  # the parameter holds D/2 key weights: the pair tie is structural
        k_weights, _ = layer.self_attn.fusion.weights()
        assert all(torch.equal(w[:, : HEAD_DIM // 2], w[:, HEAD_DIM // 2:]) for w in k_weights)
    want = _logits(teacher, batches)
    assert _logits(student, batches) == pytest.approx(want, abs=1e-10)  # the converted model is the teacher
    assert (before - want).abs().max() > 1e-3  # and the paper's initialisation was not


def test_calibrated_sources_are_the_fused_ones():
    truth = {3: (0, 2), 4: (1, 2), 5: (0, 1)}
    teacher, weights = _fusion_teacher(6, truth, seed=1)
    batches = _batches(seed=1)
    plan = _student(teacher, "fusedkv").plan
    fits = fit_fusion(teacher, plan, batches, choose_sources=True)
    assert {f.index: (f.k_sources, f.v_sources) for f in fits} == {i: (s, s) for i, s in truth.items()}
    student = _student(teacher, "custom", kv_source_map=source_map(plan, fits))
    assert student.config.kv_sharing == "custom" and student.plan.storage_layers == (0, 1, 2)
    set_fusion(student, fits)
    assert _logits(student, batches) == pytest.approx(_logits(teacher, batches), abs=1e-10)
    # The custom map decodes as it forwards: cached one-token steps give the full forward's logits.
    ids = batches[0]
    full = _logits(student, [ids])[0]
    with torch.no_grad():
        out = student(ids[:, :10], use_cache=True)
        steps = [out.logits[0, -1]]
        cache = out.cache
        for t in range(10, ids.shape[1]):
            out = student(ids[:, t: t + 1], cache=cache, use_cache=True)
            cache = out.cache
            steps.append(out.logits[0, -1])
    assert torch.stack(steps) == pytest.approx(full[9:], abs=1e-9)


@pytest.mark.parametrize("plan", ["fusedkv", "fusedkv-lite"])
def test_layer_refits_lower_the_errors_they_fit(plan):
    torch.manual_seed(2)
    teacher = FusedKVForCausalLM(_config(4)).double().eval()
    batches = _batches(n=4, tokens=32, seed=2)
    plain = _student(teacher, plan)
    fits = fit_fusion(teacher, plain.plan, batches)
    fused_only = _student(teacher, plan)
    set_fusion(fused_only, fits)
    refitted = copy.deepcopy(fused_only)
    o_only = copy.deepcopy(fused_only)
    refit_layers(teacher, o_only, batches, copy.deepcopy(fits), stages=("o_proj",))
    refit_layers(teacher, refitted, batches, fits)
    for fit in fits:
        e = fit.errors
        assert e["o_proj_after"] < e["o_proj_before"] and e["mlp_after"] < e["mlp_before"]
    # Fitted on these tokens, the refitted model's logits are closer to the teacher's at every stage.
    want = _logits(teacher, batches)
    err = {name: float((_logits(m, batches) - want).square().mean())
           for name, m in (("plain", plain), ("fusion", fused_only), ("o_proj", o_only), ("all", refitted))}
    if plan == "fusedkv":
        assert err["fusion"] < err["plain"]
    assert err["all"] < err["o_proj"] < err["fusion"]
    # Only the reconstruction layers' o_proj and down_proj moved; the lower layers are untouched.
    changed = {k for k, v in refitted.state_dict().items() if not torch.equal(v, fused_only.state_dict()[k])}
    upper = {f"model.layers.{i}.{n}.weight" for i in plain.plan.reconstruction_layers
             for n in ("self_attn.o_proj", "mlp.down_proj")}
    assert changed == upper
