"""Import of Hugging Face Qwen3 checkpoints: exact parity with transformers for the vanilla plan, and
a trainable starting point for the half-cache plans."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from fusedkv import FusedKVForCausalLM
from fusedkv.convert import convert_qwen3


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(path)
    return path, model


def test_vanilla_conversion_matches_transformers_qwen3(qwen3_dir, tmp_path):
    src, reference = qwen3_dir
    convert_qwen3(src, tmp_path, kv_sharing="vanilla")
    ours = FusedKVForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 101, (2, 40))
    with torch.no_grad():
        got, want = ours(ids, use_cache=False, output_hidden_states=True), reference(ids, output_hidden_states=True)
        assert (got.logits - want.logits).abs().max() < 1e-4
        # transformers' convention: the embeddings, each layer's output, the last one after the final norm
        assert len(got.hidden_states) == len(want.hidden_states) == 5
        for a, b in zip(got.hidden_states, want.hidden_states, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        # greedy generation agrees token for token
        a = ours.generate(ids[:1, :10], max_new_tokens=10, do_sample=False)
        b = reference.generate(ids[:1, :10], max_new_tokens=10, do_sample=False)
    assert torch.equal(a, b)


def test_tied_embeddings_checkpoint_converts(tmp_path):
    torch.manual_seed(1)
    cfg = Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    ref = Qwen3ForCausalLM(cfg).eval()
    ref.save_pretrained(tmp_path / "src")
    ours = convert_qwen3(tmp_path / "src", tmp_path / "dst", kv_sharing="vanilla").eval()
    ids = torch.randint(0, 50, (1, 12))
    with torch.no_grad():
        assert (ours(ids, use_cache=False).logits - ref(ids).logits).abs().max() < 1e-4


def test_half_cache_conversion_keeps_storage_weights(qwen3_dir, tmp_path):
    src, reference = qwen3_dir
    model = convert_qwen3(src, tmp_path, kv_sharing="fusedkv")
    ref_state = reference.state_dict()
    for name, tensor in model.state_dict().items():
        if ".fusion." not in name:
            assert torch.equal(tensor, ref_state[name]), name
    assert "model.layers.3.self_attn.k_proj.weight" not in model.state_dict()
    fusion = model.model.layers[2].self_attn.fusion.k_weight
    assert torch.allclose(fusion[:, 0, 0], torch.tensor([0.5, 0.5]))  # equivalent initialisation
    loaded = FusedKVForCausalLM.from_pretrained(tmp_path)
    assert loaded.plan.storage_layers == (0, 1)


def test_convert_rejects_an_unsupported_model_type(tmp_path):
    import json

    from tests.conftest import tiny_model

    tiny_model("vanilla").save_pretrained(tmp_path / "src")
    cfg = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(json.dumps({**cfg, "model_type": "falcon"}))
    with pytest.raises(ValueError, match="expected a Qwen3, Llama.* checkpoint .* got model_type .falcon."):
        convert_qwen3(tmp_path / "src", tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_convert_rejects_a_fusedkv_model_without_its_upper_kv(tmp_path):
    from tests.conftest import tiny_model

    tiny_model("fusedkv").save_pretrained(tmp_path / "src")
    with pytest.raises(ValueError, match="only a vanilla"):
        convert_qwen3(tmp_path / "src", tmp_path / "dst", kv_sharing="yoco")
