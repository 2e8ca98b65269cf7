"""`reduce_precision(..., int4_rule=)`: the scale rule is a per-call choice, not module state."""

import torch

from fusedkv import FusedKVConfig, FusedKVForCausalLM
from fusedkv.engine import precision
from fusedkv.engine.precision import ReducedLinear, quantize_int4, reduce_precision
from fusedkv.kernels import cpu_gemv


def _model():
    torch.manual_seed(0)
    cfg = FusedKVConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, head_dim=16, kv_sharing="vanilla")
    return FusedKVForCausalLM(cfg).eval()


def test_reduce_precision_passes_its_int4_rule_to_every_product():
    w = _model().model.layers[0].mlp.down_proj.weight.detach().clone()
    stored = {}
    for rule in precision.INT4_RULES:
        down = reduce_precision(_model(), "int4", int4_rule=rule).model.layers[0].mlp.down_proj
        assert isinstance(down, ReducedLinear)
        packed, scales = cpu_gemv.to_int4_blocks(*quantize_int4(w, rule=rule))
        assert torch.equal(down.weight, packed) and torch.equal(down.scale, scales)
        stored[rule] = down.scale
    assert precision.INT4_RULE == "mse"  # a call that chose another rule leaves the default as it was
    assert not torch.equal(*stored.values())  # the rules chose different scales
