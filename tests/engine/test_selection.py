"""`select_runtime`: one `Runtime` value decides how the model runs, once, and `generate` only applies it.

Checked here: what the value holds for a model (every seam it sets, the layout, the step), that a plain model
nobody selected for runs the model's own forms, that the seams come back on exit and on a move or cast, and
that the runtime's forms give the reference's logits (MoE grouped against the per-expert loop, the fused
QK-norm + RoPE pass against the two-step one)."""

import pytest
import torch

from fusedkv.cache import StaticKVCache
from fusedkv.engine.packing import is_packed
from fusedkv.engine.selection import GROUPED_MM_DTYPES, product_rule, select_runtime
from fusedkv.generation import generate
from fusedkv.kernels import native
from fusedkv.model.attention import Attention, ReferenceAttention
from fusedkv.model.moe import Experts
from tests.conftest import tiny_model

MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24)


def _seams(model):
    attn = [m for m in model.modules() if isinstance(m, Attention)]
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    return ([type(a.implementation).__name__ for a in attn], [a.fused_qk_rope for a in attn],
            [e.grouped for e in experts])


def test_a_plain_model_runs_its_own_forms_and_the_runtime_sets_every_seam_once():
    model = tiny_model("fusedkv", use_qk_norm=True, **MOE)
    own = _seams(model)
    assert own[0] == ["ReferenceAttention"] * 4 and not any(own[1]) and not any(own[2])
    cache = StaticKVCache(model.config, 1, 16)
    with select_runtime(model, cache=cache, batch=1, native_step=True, weight_layout="auto") as runtime:
        names, qk, grouped = _seams(model)
        assert names == [runtime.attention[i] for i in range(4)] and "ReferenceAttention" not in names
        assert all(qk) == runtime.fused_qk_rope is True  # an f32 model with QK-norm
        assert grouped == [runtime.moe_grouped] * len(grouped) and runtime.moe_grouped  # f32 on CPU
        assert runtime.products == product_rule(model)
        assert runtime.layout in ("packed", "row-major") and is_packed(model) == (runtime.layout == "packed")
        if native.available():  # the step covers f32 MoE models in the packed layout
            assert runtime.native_step is not None and runtime.layout == "packed"
    assert _seams(model) == own  # given back; the layout stays (it changes no value)
    select_runtime(model)
    model.to(torch.float64)  # a move or cast resets every seam: the old choice was for f32
    assert _seams(model) == own
    assert isinstance(model.model.layers[0].self_attn.implementation, ReferenceAttention)


def test_the_runtime_forms_match_the_models_own():
    """MoE grouped GEMM vs the per-expert loop, the fused QK-norm + RoPE pass vs two steps, engine attention vs
    the reference: the same logits up to f32 rounding, for a prompt and one decode step."""
    model = tiny_model("fusedkv", use_qk_norm=True, **MOE)
    ids = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        def logits():
            out = model(ids[:, :6], use_cache=True)
            return out.logits, model(ids[:, 6:], cache=out.cache, use_cache=True).logits
        ref = logits()
        with select_runtime(model) as runtime:
            assert runtime.moe_grouped and runtime.fused_qk_rope
            got = logits()
    for a, b in zip(got, ref):
        assert (a - b).abs().max() < 1e-5


def test_no_grouped_gemm_where_torch_has_none():
    model = tiny_model("vanilla", dtype=torch.float64, **MOE)  # fp64: the reference precision
    assert torch.float64 not in GROUPED_MM_DTYPES["cpu"]
    with select_runtime(model) as runtime:
        assert not runtime.moe_grouped and not runtime.fused_qk_rope


def test_generate_applies_the_runtime_and_refuses_unknown_choices():
    model = tiny_model("fusedkv")
    ids = torch.randint(1, 97, (1, 6))
    ref = generate(model, ids, 4).tokens
    assert torch.equal(generate(model, ids, 4, weight_layout="auto").tokens, ref)
    with pytest.raises(ValueError, match="weight_layout"):
        select_runtime(model, weight_layout="columns")
    with pytest.raises(ValueError, match="attention implementation 'fast'"):
        select_runtime(model, "fast")
