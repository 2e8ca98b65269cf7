"""The packed decode layout (`fusedkv.engine.packing`, laid out by the selection's rule): a re-layout that
must change nothing but speed. Outputs, parameter names and values, checkpoints and training are checked
against the unpacked model; the packed GEMV must really run (one product per group, counted by the
profiler) and be dropped when the parameters move."""

import copy

import pytest
import torch
from torch.profiler import profile

from fusedkv import FusedKVForCausalLM
from fusedkv.engine.packing import is_packed, unpack_weights
from fusedkv.engine.selection import product_rule, set_decode_layout
from fusedkv.generation import generate
from fusedkv.kernels import native
from tests.conftest import PLAN_CONFIGS, tiered, tiny_model
from tests.model.test_decode import incremental_logits, padded_batch


def pack_for_decode(model):
    """The packed layout by this machine's product rule (`fusedkv.engine.selection.product_rule`)."""
    return set_decode_layout(model, "packed")


# The fast tier: every plan at batch 2 (left padding), batch 1 for vanilla and FusedKV.
@pytest.mark.parametrize("plan_name, batch", tiered([(plan, batch) for plan in PLAN_CONFIGS for batch in (1, 2)],
                                                    lambda plan, batch: batch == 2 or plan in ("vanilla", "fusedkv")))
def test_packed_decode_matches_unpacked(plan_name, batch):
    model = tiny_model(plan_name)
    packed = pack_for_decode(copy.deepcopy(model))
    assert is_packed(packed) and not is_packed(model)
    ids, mask, width = padded_batch(9)
    ids, mask = ids[:batch], mask[:batch]
    with torch.no_grad():
        ref, _ = incremental_logits(model, ids, mask, width)
        out, _ = incremental_logits(packed, ids, mask, width)
        full = packed(ids, attention_mask=mask, use_cache=False).logits
    for a, b in zip(ref, out):
        assert (a - b).abs().max() < 1e-5
    assert (full[:, width:] - torch.cat(out[1:], dim=1)).abs().max() < 1e-4


def test_packing_keeps_names_values_and_buffers_shared():
    model = tiny_model("fusedkv")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params_before = {id(p) for p in model.parameters()}
    pack_for_decode(model)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert {id(p) for p in model.parameters()} == params_before  # optimizers keep their references
    attn = model.model.layers[0].self_attn
    packed = attn.packed_qkv.weight
    assert attn.q_proj.weight.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()
    assert attn.v_proj.weight.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()
    assert packed.t().is_contiguous()  # column-major
    # MKL streams the down projection faster row-major; the native kernel reads every weight column-major
    assert model.model.layers[0].mlp.down_proj.weight.is_contiguous() != product_rule(model).native
    pack_for_decode(model)  # idempotent
    assert model.model.layers[0].self_attn.packed_qkv.weight.data_ptr() == packed.data_ptr()


def _linear_calls(model, ids, cache):
    with profile() as prof:
        model(ids, cache=cache, use_cache=True)
    return sum(e.count for e in prof.key_averages() if e.key == "aten::linear")


def test_batch_one_decode_runs_one_product_per_packed_group(torch_kernels):
    model = tiny_model("vanilla")  # 4 storage layers: q,k,v,o,gate,up,down + lm_head = 29 products
    ids = torch.randint(1, 97, (1, 6))
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache
        assert _linear_calls(model, ids[:, -1:], cache) == 4 * 7 + 1
        pack_for_decode(model)
        assert _linear_calls(model, ids[:, -1:], cache) == 4 * 4 + 1  # qkv, o, gate|up, down
        # A prefill block has more rows than the rule's max_rows: separate products there.
        assert _linear_calls(model, ids, None) == 4 * 7 + 1


@pytest.mark.skipif(not native.available(), reason="no C compiler: the native CPU kernel is not built")
def test_with_the_native_kernel_a_decode_step_runs_no_torch_product():
    model = tiny_model("vanilla")
    ids = torch.randint(1, 97, (1, 6))
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache
        pack_for_decode(model)
        assert _linear_calls(model, ids[:, -1:], cache) == 0  # every product, the LM head too, is native
        assert _linear_calls(model, ids, None) == 4 * 7 + 1  # a prefill block keeps PyTorch's GEMM


def test_save_and_reload_of_a_packed_model(tmp_path):
    model = tiny_model("fusedkv", tie_word_embeddings=True)
    ids = torch.randint(1, 97, (1, 8))
    with torch.no_grad():
        ref = model(ids).logits
    pack_for_decode(model)
    model.save_pretrained(tmp_path)
    loaded = FusedKVForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # the tie survives
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ref)


def test_moving_the_model_drops_packing_safely_and_repacking_restores_it():
    model = pack_for_decode(tiny_model("fusedkv-lite"))
    ids = torch.randint(1, 97, (1, 12))
    ref = generate(model, ids, 6, weight_layout="keep").tokens
    model.to(torch.float64)  # new storage: the packed buffers are stale and must not be used
    assert not is_packed(model)
    assert torch.equal(generate(model, ids, 6, weight_layout="keep").tokens, ref)
    assert torch.equal(generate(model, ids, 6, weight_layout="packed").tokens, ref) and is_packed(model)
    unpack_weights(model)
    assert not is_packed(model) and all(p.is_contiguous() for p in model.parameters())


def test_training_a_packed_model_updates_the_packed_buffers():
    model = pack_for_decode(tiny_model("fusedkv")).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(1, 97, (2, 16))
    model(ids, labels=ids).loss.backward()
    opt.step()
    assert is_packed(model)  # in-place updates keep the views
    model.eval()
    unpacked = unpack_weights(copy.deepcopy(model))
    one = ids[:1, :5]
    with torch.no_grad():
        a = model(one, use_cache=True)
        b = unpacked(one, use_cache=True)
        step_a = model(ids[:1, 5:6], cache=a.cache, use_cache=True).logits
        step_b = unpacked(ids[:1, 5:6], cache=b.cache, use_cache=True).logits
    assert (step_a - step_b).abs().max() < 1e-5


def test_gradients_reach_the_weights_of_a_packed_model_even_for_one_token():
    model = pack_for_decode(tiny_model("vanilla")).train()
    model(torch.randint(1, 97, (1, 1))).logits.sum().backward()
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    for p in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_generate_keeps_the_callers_layout_unless_asked():
    model = tiny_model("fusedkv")
    ids = torch.randint(1, 97, (4, 10))
    ref = generate(model, ids, 5).tokens
    assert not is_packed(model) and all(p.is_contiguous() for p in model.parameters())
    pack_for_decode(model)
    assert torch.equal(generate(model, ids, 5).tokens, ref) and is_packed(model)  # still the caller's layout


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_generate_auto_chooses_the_layout_by_batch_size(kernels, request):
    if kernels == "torch":
        request.getfixturevalue("torch_kernels")
    elif not native.available():
        pytest.skip("no C compiler: the native CPU kernel is not built")
    model = tiny_model("fusedkv")
    ids = torch.randint(1, 97, (4, 10))
    ref = generate(model, ids, 5).tokens
    one = generate(model, ids[:1], 5, weight_layout="auto")
    assert is_packed(model)  # batch 1: one GEMV per group
    four = generate(model, ids, 5, weight_layout="auto")
    if 4 <= product_rule(model).max_rows:  # the native kernel: column-major up to its MAX_ROWS
        assert is_packed(model)
    else:
        assert not is_packed(model) and all(p.is_contiguous() for p in model.parameters())  # batch 4: row-major
    assert torch.equal(four.tokens, ref) and torch.equal(one.tokens, ref[:1])
    with pytest.raises(ValueError, match="weight_layout"):
        generate(model, ids, 2, weight_layout="column")
