"""TrainConfig: presets, layering (preset < YAML < --set < flags), derived values, clear errors."""

from __future__ import annotations

import pytest

from fusedkv import FusedKVConfig
from fusedkv.train import PRESET_NAMES, PRESETS, TrainConfig, resolve_config


def test_presets_exist_and_build_models():
    assert {"332m", "650m", "1.5b", "4b", "tiny", "nano"} <= set(PRESET_NAMES)
    paper = {"332m": (12, 1024, 16), "650m": (16, 1536, 16), "1.5b": (24, 2048, 16), "4b": (36, 2560, 32)}
    for name, (layers, hidden, heads) in paper.items():
        cfg = TrainConfig(preset=name)
        m = cfg.model
        assert (m["num_hidden_layers"], m["hidden_size"], m["num_attention_heads"]) == (layers, hidden, heads)
        assert cfg.vocab_size == 128_000 and cfg.seq_len == 8192 and cfg.rope_base == 10_000
        assert cfg.lr == 3e-4 and cfg.min_lr_ratio == 0.1 and cfg.warmup_steps == 2000
        assert cfg.betas == (0.9, 0.95) and cfg.weight_decay == 0.1 and cfg.grad_clip == 1.0
        assert cfg.global_batch_sequences == 512
        FusedKVConfig(vocab_size=cfg.vocab_size, kv_sharing="fusedkv", **m)  # a valid model
    assert TrainConfig(preset="332m").total_steps() == -(-200_000_000_000 // (512 * 8192))


def test_defaults_are_the_tiny_fusedkv_run():
    cfg = TrainConfig()
    assert cfg.preset == "tiny" and cfg.plan == "fusedkv" and cfg.data == "builtin"
    assert cfg.out_dir == "runs/tiny-fusedkv"
    assert cfg.distributed == "none" and cfg.dtype == "auto" and cfg.resume is False


def test_grad_accumulation_is_derived():
    cfg = TrainConfig(preset="nano")  # 8 sequences, micro-batch 4
    assert cfg.grad_accum_steps(1) == 2 and cfg.grad_accum_steps(2) == 1
    with pytest.raises(ValueError, match="micro_batch_size"):
        cfg.grad_accum_steps(4)
    with pytest.raises(ValueError, match="micro_batch_size"):
        TrainConfig(preset="nano", micro_batch_size=3)
    with pytest.raises(ValueError, match="global_batch_tokens"):
        TrainConfig(preset="nano", global_batch_tokens=500)


def test_preset_micro_batch_adapts_to_longer_sequences():
    cfg = TrainConfig(seq_len=512)  # tiny: 2048 tokens per step = 4 sequences of 512
    assert cfg.micro_batch_size == 4 and cfg.grad_accum_steps() == 1
    assert TrainConfig(preset="nano", seq_len=128).micro_batch_size == 4
    with pytest.raises(ValueError, match="micro_batch_size"):
        TrainConfig(seq_len=512, micro_batch_size=8)  # an explicit value is not changed behind your back


def test_layers_yaml_set_and_flags(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("preset: nano\nplan: vanilla\nlr: 0.01\nmodel:\n  hidden_size: 128\nmax_steps: 5\n")
    cfg = resolve_config(
        y,
        [
            "lr=2e-3",
            "model.num_hidden_layers=6",
            "intermediate_size=256",
            "betas=[0.9, 0.99]",
            "max_tokens=2k",
        ],
        seed=7,
        plan=None,
    )
    assert cfg.preset == "nano" and cfg.plan == "vanilla" and cfg.seed == 7
    assert cfg.lr == 2e-3 and cfg.betas == (0.9, 0.99)
    assert cfg.model["hidden_size"] == 128 and cfg.model["num_hidden_layers"] == 6
    assert cfg.model["intermediate_size"] == 256 and cfg.model["num_attention_heads"] == 4  # preset kept
    # max_tokens set above max_steps' layer: max_steps from the YAML is dropped.
    assert cfg.max_steps is None and cfg.max_tokens == 2000 and cfg.total_steps() == 4
    assert resolve_config(None, ["rope_theta=50000"]).rope_base == 50000.0


def test_round_trip():
    cfg = resolve_config(None, ["preset=nano", "seed=3", "model.fusion_init=normal"])
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["lrr=1"], "lrr"),
        (["lr=abc"], "lr"),
        (["lr=-1"], "lr"),
        (["plan=foo"], "plan"),
        (["model.hiden_size=3"], "hiden_size"),
        (["distributed=horovod"], "distributed"),
        (["compile=maybe"], "compile"),
        (["betas=[0.9]"], "betas"),
        (["max_steps=1.5"], "max_steps"),
        (["model.vocab_size=10"], "vocab_size"),
        (["model.kv_sharing=yoco"], "plan"),
        (["min_lr_ratio=2"], "min_lr_ratio"),
        (["preset=huge"], "preset"),
        (["noequals"], "key=value"),
    ],
)
def test_invalid_values_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        resolve_config(None, overrides)


def test_bad_yaml(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        resolve_config(tmp_path / "list.yaml")


def test_init_from_takes_architecture_from_checkpoint():
    cfg = TrainConfig(init_from="somewhere", seq_len=128)
    assert cfg.plan is None and cfg.vocab_size is None and cfg.rope_base is None and cfg.model == {}
    assert cfg.lr == PRESETS["tiny"]["lr"]  # the recipe still comes from the preset
