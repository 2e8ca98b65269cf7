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
        assert cfg.vocab_size == 128_000 and cfg.seq_len == 8192 and cfg.rope_theta == 10_000
        assert cfg.lr == 3e-4 and cfg.min_lr_ratio == 0.1 and cfg.warmup_steps == 2000
        assert cfg.betas == (0.9, 0.95) and cfg.weight_decay == 0.1 and cfg.grad_clip == 1.0
        assert cfg.global_batch_sequences == 512
        FusedKVConfig(vocab_size=cfg.vocab_size, kv_sharing="fusedkv", **m)  # a valid model
    assert TrainConfig(preset="332m").total_steps() == -(-200_000_000_000 // (512 * 8192))


def test_defaults_are_the_tiny_fusedkv_run():
    cfg = TrainConfig()
    assert cfg.preset == "tiny" and cfg.kv_sharing == "fusedkv" and cfg.data == "builtin"
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
    assert cfg.preset == "nano" and cfg.kv_sharing == "vanilla" and cfg.seed == 7
    assert cfg.lr == 2e-3 and cfg.betas == (0.9, 0.99)
    assert cfg.model["hidden_size"] == 128 and cfg.model["num_hidden_layers"] == 6
    assert cfg.model["intermediate_size"] == 256 and cfg.model["num_attention_heads"] == 4  # preset kept
    # max_tokens set above max_steps' layer: max_steps from the YAML is dropped.
    assert cfg.max_steps is None and cfg.max_tokens == 2000 and cfg.total_steps() == 4
    assert resolve_config(None, ["rope_theta=50000"]).rope_theta == 50000.0


def test_one_name_per_field_and_old_names_still_read():
    cfg = resolve_config(None, ["preset=nano", "model.vocab_size=1024", "model.kv_sharing=yoco", "rope_base=5e4"])
    assert cfg.vocab_size == 1024 and cfg.kv_sharing == "yoco" and cfg.rope_theta == 50_000.0
    assert "vocab_size" not in cfg.model and "kv_sharing" not in cfg.model
    assert resolve_config(None, plan="cla").kv_sharing == "cla"  # --plan, what users type
    # A config saved before the rename (train_config.json of an old checkpoint).
    old = {**TrainConfig(preset="nano").to_dict(), "plan": "cla", "rope_base": 20_000.0}
    del old["kv_sharing"], old["rope_theta"]
    cfg = TrainConfig.from_dict(old)
    assert cfg.kv_sharing == "cla" and cfg.rope_theta == 20_000.0
    assert TrainConfig(preset="4b").grad_checkpointing and not TrainConfig(preset="332m").grad_checkpointing


def test_presets_are_package_data_files():
    from importlib import resources

    files = {p.name for p in resources.files("fusedkv.train").joinpath("presets").iterdir()}
    assert {f"{n}.yaml" for n in PRESET_NAMES} <= files
    assert PRESETS["4b"]["lr"] == 3e-4 and PRESETS["4b"]["model"]["intermediate_size"] == 9728  # via extends


def test_round_trip():
    cfg = resolve_config(None, ["preset=nano", "seed=3", "model.fusion_init=normal"])
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["lrr=1"], "lrr"),
        (["lr=abc"], "lr"),
        (["lr=-1"], "lr"),
        (["plan=foo"], "foo"),
        (["model.hiden_size=3"], "hiden_size"),
        (["distributed=horovod"], "distributed"),
        (["compile=maybe"], "compile"),
        (["betas=[0.9]"], "betas"),
        (["max_steps=1.5"], "max_steps"),
        (["model.kv_sharing=bogus"], "bogus"),
        (["model.hidden_size=abc"], "model.hidden_size"),
        (["model.rms_norm_eps=abc"], "model.rms_norm_eps"),
        (["model.num_attention_heads=5"], "num_attention_heads"),
        (["model.rope_parameters={}"], "rope_parameters"),
        (["lr=nan"], "lr"),
        (["seed=-1"], "seed"),
        (["eps=0"], "eps"),
        (["grad_clip=-1"], "grad_clip"),
        (["keep_checkpoints=0"], "keep_checkpoints"),
        (["threads=0"], "threads"),
        (["model.", "x"], "key=value"),
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
    assert cfg.kv_sharing is None and cfg.vocab_size is None and cfg.rope_theta is None and cfg.model == {}
    assert cfg.lr == PRESETS["tiny"]["lr"]  # the recipe still comes from the preset
