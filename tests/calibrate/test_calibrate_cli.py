"""`fusedkv convert --fusion-init calibrated` end to end through the real CLI on a tiny Llama checkpoint (built
with transformers' own class, with a BPE tokenizer), and the flags `fusedkv uptrain` carries into its run."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch

from tests import _cli as cli_process

REPO = Path(__file__).resolve().parents[2]
VOCAB = 320


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from fusedkv.data import read_builtin_text
    from fusedkv.data.tokenizer import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("calib")
    train_bpe_tokenizer([read_builtin_text(limit_chars=60_000)], VOCAB, root / "src")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128))
    model.save_pretrained(root / "src")
    return root / "src"


def _env(tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "FUSEDKV_DEBUG"}
    env.update(PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    return env


def _convert(tmp_path, *args) -> cli_process.Result:
    return cli_process.fusedkv("convert", *map(str, args), cwd=REPO, env=_env(tmp_path), timeout=600)


def _teacher_error(model, teacher, ids) -> float:
    with torch.no_grad():
        return float((model(ids, use_cache=False).logits - teacher(ids).logits).square().mean())


def test_convert_calibrated_end_to_end(tmp_path, llama):
    from transformers import AutoTokenizer, LlamaForCausalLM

    from fusedkv import FusedKVForCausalLM
    from fusedkv.convert import convert_checkpoint
    from fusedkv.data import read_builtin_text

    dst = tmp_path / "calibrated"
    r = _convert(tmp_path, llama, dst, "--plan", "fusedkv", "--fusion-init", "calibrated", "--calib-data", "builtin",
                 "--calib-tokens", 256)
    assert r.returncode == 0, r.stderr
    report = json.loads((dst / "calibration.json").read_text())
    assert report["tokens"] == 256 and report["sequences"] == 2  # context 128: two sequences
    assert report["settings"]["data"] == "builtin" and [f["layer"] for f in report["layers"]] == [3, 4]
    assert all(f["o_proj_after"] < f["o_proj_before"] for f in report["layers"])
    assert (dst / "tokenizer.json").is_file()
    model = FusedKVForCausalLM.from_pretrained(dst).eval()
    plain = convert_checkpoint(llama, tmp_path / "plain", kv_sharing="fusedkv").eval()
    teacher = LlamaForCausalLM.from_pretrained(llama).eval()
    ids = AutoTokenizer.from_pretrained(llama)(read_builtin_text(limit_chars=2000), return_tensors="pt").input_ids
    ids = ids[:, :128]
    assert _teacher_error(model, teacher, ids) < _teacher_error(plain, teacher, ids)
    for layer in model.model.layers[2:]:
        assert not torch.equal(layer.self_attn.fusion.k_weight, plain.model.layers[2].self_attn.fusion.k_weight)


def test_convert_calibrated_sources_and_bad_data(tmp_path, llama):
    dst = tmp_path / "sources"
    r = _convert(tmp_path, llama, dst, "--plan", "fusedkv-lite", "--fusion-init", "calibrated", "--calib-tokens", 128,
                 "--sources", "calibrated")
    assert r.returncode == 0, r.stderr
    config = json.loads((dst / "config.json").read_text())
    assert config["kv_sharing"] == "custom"
    assert [e["layers"] for e in config["kv_source_map"]] == [[3, 3], [4, 4]]
    assert all(e["k_fusion"] == e["v_fusion"] == "reuse" and len(e["k"]) == len(e["v"]) == 1
               for e in config["kv_source_map"])
    bad = tmp_path / "bad"
    r = _convert(tmp_path, llama, bad, "--plan", "fusedkv", "--fusion-init", "calibrated", "--calib-data",
                 tmp_path / "missing.txt")
    assert r.returncode == 2 and "--calib-data" in r.stderr and "Traceback" not in r.stderr
    assert not bad.exists()


def test_uptrain_carries_the_calibration_flags(tmp_path):
    from fusedkv.uptrain.command import add_arguments, build

    parser = add_arguments(argparse.ArgumentParser())
    args = parser.parse_args([str(tmp_path / "src"), str(tmp_path / "out"), "--fusion-init", "calibrated",
                              "--calib-data", "builtin", "--calib-tokens", "512", "--sources", "calibrated"])
    settings = build(args).settings()
    assert settings["fusion_init"] == "calibrated"
    assert settings["calibration"] == {"data": "builtin", "tokens": 512, "sources": "calibrated"}
    plain = build(parser.parse_args([str(tmp_path / "src"), str(tmp_path / "out")])).settings()
    assert "calibration" not in plain  # the settings of runs without calibration are what they were


def test_training_starts_from_a_custom_plan_checkpoint():
    """`--sources calibrated` writes a custom source map; training from that checkpoint (uptrain's stage 3, `fusedkv
    train --init-from`) takes the checkpoint's map, while a fresh custom model still needs one."""
    from fusedkv.train import TrainConfig

    TrainConfig(init_from="converted", kv_sharing="custom", max_steps=1).validate()
    with pytest.raises(ValueError, match="kv_source_map"):
        TrainConfig(kv_sharing="custom", max_steps=1, vocab_size=10).validate()
