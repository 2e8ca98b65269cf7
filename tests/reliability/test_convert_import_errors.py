"""`fusedkv convert` of checkpoints it cannot import exactly, through the real CLI (issue 27, items 2 and 12):
a truncated safetensors file is a one-line error naming the file (was: "internal error: SafetensorError");
a config field fusedkv cannot reproduce is refused naming it; a `hidden_act` it can reproduce is computed
(was: gelu imported as SiLU)."""

from __future__ import annotations

import json
import shutil

import torch

from tests.reliability.conftest import assert_one_line_error


def test_a_truncated_safetensors_file_names_the_file(cli, qwen3_src, tmp_path):
    src = tmp_path / "truncated"
    shutil.copytree(qwen3_src, src)
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert_one_line_error(cli("convert", src, tmp_path / "dst"), 2, str(weights), "truncated")
    assert not (tmp_path / "dst").exists()


def test_a_shard_the_index_names_but_is_missing(cli, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "src", max_shard_size="20KB")
    shard = sorted((tmp_path / "src").glob("model-*.safetensors"))[-1]
    shard.unlink()
    assert_one_line_error(cli("convert", tmp_path / "src", tmp_path / "dst"), 2, shard.name)


def test_an_unsupported_field_is_refused_naming_it(cli, qwen3_src, tmp_path):
    src = tmp_path / "gelu10"
    shutil.copytree(qwen3_src, src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu_10"}))
    assert_one_line_error(cli("convert", src, tmp_path / "dst"), 2, "config field hidden_act='gelu_10'")
    assert not (tmp_path / "dst").exists()


def test_a_gelu_qwen3_is_imported_with_gelu(cli, tmp_path):
    """Was: hidden_act gelu imported as SiLU, logits off by 0.014."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from fusedkv import FusedKVForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16, hidden_act="gelu", initializer_range=0.1)
    ref = Qwen3ForCausalLM(cfg).eval()
    ref.save_pretrained(tmp_path / "src")
    r = cli("convert", tmp_path / "src", tmp_path / "dst")
    assert r.returncode == 0, r.stderr
    ours = FusedKVForCausalLM.from_pretrained(tmp_path / "dst").eval()
    assert ours.config.hidden_act == "gelu"
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        assert (ours(ids).logits - ref(ids).logits).abs().max() < 1e-5


def test_convert_help_lists_every_family(cli):
    from fusedkv.convert import FAMILIES

    out = cli("convert", "--help").stdout
    for family in FAMILIES:
        assert family.name in out and all(t in out for t in family.model_types)
