"""Model-level properties: RoPE relative-position invariance of fused keys, fusion initialisation,
save/load round trips, Auto classes, and clear errors on bad input."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from fusedkv import FusedKVConfig, FusedKVForCausalLM
from tests.conftest import randomize_fusion, tiny_config, tiny_model


def shifted_logits(model, shift):
    ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(12).expand(2, 12) + shift
    with torch.no_grad():
        return model(ids, position_ids=pos, use_cache=False).logits


@pytest.mark.parametrize("plan", ["fusedkv", "fusedkv-dense", "single-source-scaling"])
def test_tied_key_weights_keep_scores_relative(plan):
    """Paper Sec. 2.4, Eqs. (7)-(8): with tied key weights only relative positions matter (float64, < 1e-10)."""
    model = tiny_model(plan, dtype=torch.float64)
    assert (shifted_logits(model, 0) - shifted_logits(model, 37)).abs().max() < 1e-10


def test_untied_key_weights_leak_absolute_position():
    model = tiny_model("fusedkv", dtype=torch.float64, tie_rope_pairs=False)
    assert model.model.layers[2].self_attn.fusion.k_weight.shape[-1] == 16  # one weight per channel
    assert (shifted_logits(model, 0) - shifted_logits(model, 37)).abs().max() > 1e-6


def test_fused_attention_scores_are_shift_invariant_directly():
    """The same property at the level of one score q^T (a1 (.) K^1 + a2 (.) K^n)."""
    from fusedkv.model.layers import apply_rope, rope_cos_sin

    torch.manual_seed(0)
    model = tiny_model("fusedkv", dtype=torch.float64)
    fusion = model.model.layers[3].self_attn.fusion
    q, k1, kn = (torch.randn(1, 4, 6, 16, dtype=torch.float64) for _ in range(3))

    def scores(shift, weights):
        cos, sin = rope_cos_sin(torch.arange(6)[None] + shift, 16, 10000.0, torch.float64)
        rq, r1, rn = (apply_rope(x, cos, sin) for x in (q, k1, kn))
        key = weights[0][None, :, None] * r1 + weights[1][None, :, None] * rn
        return rq @ key.transpose(-1, -2)

    tied = [w.detach() for w in fusion.key_weights()]
    assert (scores(0, tied) - scores(100, tied)).abs().max() < 1e-10
    untied = [w + torch.randn_like(w) for w in tied]
    assert (scores(0, untied) - scores(100, untied)).abs().max() > 1e-3


def test_equivalent_init_reproduces_iterative_at_step_zero():
    """Every layer's hidden state (hence every reconstructed K/V) agrees at step 0."""
    cfg_eq = tiny_config(kv_sharing="fusedkv", num_hidden_layers=8, fusion_init="equivalent")
    cfg_it = tiny_config(kv_sharing="fusedkv", num_hidden_layers=8, fusion_init="iterative")
    torch.manual_seed(0)
    eq = FusedKVForCausalLM(cfg_eq).double().eval()
    it = FusedKVForCausalLM(cfg_it).double().eval()
    it.load_state_dict({k: v for k, v in eq.state_dict().items() if "fusion" not in k}, strict=False)
    w = eq.model.layers[6].self_attn.fusion.k_weight  # third step: (f(1 + c + c^2), c^3) = (0.875, 0.125)
    assert torch.allclose(w[:, 0, 0], torch.tensor([0.875, 0.125], dtype=torch.float64))
    ids = torch.randint(1, 97, (2, 10))
    with torch.no_grad():
        a = eq(ids, use_cache=False, output_hidden_states=True)
        b = it(ids, use_cache=False, output_hidden_states=True)
    for ha, hb in zip(a.hidden_states, b.hidden_states):
        assert (ha - hb).abs().max() < 1e-10


def test_normal_init_and_transformers_init_hook_do_not_clobber():
    torch.manual_seed(0)
    normal = FusedKVForCausalLM(tiny_config(fusion_init="normal"))
    w = normal.model.layers[2].self_attn.fusion.k_weight
    assert 0.005 < w.std().item() < 0.05  # drawn like other weights (std 0.02)
    eq = FusedKVForCausalLM(tiny_config())
    assert torch.all(eq.model.layers[2].self_attn.fusion.v_weight[0] == 0.5)


def test_reconstruction_layers_have_no_kv_projections():
    model = tiny_model("fusedkv")
    names = {n for n, _ in model.named_parameters()}
    assert "model.layers.1.self_attn.k_proj.weight" in names
    assert not any(n.startswith(("model.layers.2.self_attn.k_proj", "model.layers.3.self_attn.v_proj")) for n in names)


def test_save_load_round_trip_and_auto_classes(tmp_path):
    model = tiny_model("fusedkv")
    ids = torch.randint(1, 97, (2, 9))
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "fusedkv"
    for loader in (FusedKVForCausalLM, AutoModelForCausalLM):
        loaded = loader.from_pretrained(tmp_path).eval()
        assert isinstance(loaded, FusedKVForCausalLM)
        with torch.no_grad():
            assert torch.equal(loaded(ids, use_cache=False).logits, model(ids, use_cache=False).logits)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), FusedKVConfig)


@pytest.mark.parametrize("overrides, match", [
    (dict(num_hidden_layers=1), "at least 2 layers"),
    (dict(kv_sharing="custom", kv_source_map=[{"layers": [3, 4], "k": 1, "v": 1}, {"layers": 4, "k": 3, "v": 1}]),
     "not a storage layer"),
    (dict(head_dim=15), "head_dim=15"),
    (dict(num_key_value_heads=3), "not divisible by num_key_value_heads"),
    (dict(kv_sharing="mla-magic"), "unknown plan"),
    (dict(fusion_init="xavier"), "fusion_init"),
    (dict(kv_sharing="yoco", fusion_init="iterative"), "iterative"),
])
def test_bad_configs_raise_clear_value_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**overrides)


def test_checkpoint_of_another_model_type_is_refused(tmp_path):
    Qwen3ForCausalLM(Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2, head_dim=16)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'qwen3' model.*fusedkv convert"):
        FusedKVForCausalLM.from_pretrained(tmp_path)


def test_truncated_checkpoint_is_refused(tmp_path):
    tiny_model("fusedkv").save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated"):
        FusedKVForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        FusedKVForCausalLM.from_pretrained(str(tmp_path / "nope"))


def test_prompt_longer_than_context_is_refused():
    model = tiny_model("fusedkv")
    with pytest.raises(ValueError, match="max_position_embeddings is 128"):
        model(torch.randint(1, 97, (1, 129)))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.generate(torch.randint(1, 97, (1, 120)), max_new_tokens=20, do_sample=False, pad_token_id=0)


def test_training_step_updates_fusion_weights():
    model = tiny_model("fusedkv").train()
    randomize_fusion(model)
    ids = torch.randint(1, 97, (2, 16))
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert model.model.layers[3].self_attn.fusion.k_weight.grad.abs().sum() > 0
    assert model.model.layers[3].self_attn.fusion.v_weight.grad.abs().sum() > 0


@pytest.mark.slow
def test_checkpoint_loads_without_importing_fusedkv(tmp_path):
    """Tools that never `import fusedkv` (lm-eval's CLI) load checkpoints with trust_remote_code=True."""
    import subprocess
    import sys

    tiny_model("fusedkv").save_pretrained(tmp_path / "ckpt")
    code = ("import sys, torch; from transformers import AutoModelForCausalLM; "
            f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'ckpt')!r}, trust_remote_code=True); "
            "assert 'fusedkv' in type(m).__module__ and m.plan.storage_layers == (0, 1); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
