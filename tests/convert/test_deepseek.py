"""Import of DeepSeek-V3 / V2 checkpoints saved by transformers' own classes: logits within 1e-5 (float32) of
transformers on a left-padded batch and 32 equal greedy tokens for several config variants (q_lora on/off,
dense and MoE layers, grouped routing, interleaved RoPE or not, YaRN or not, sharded or not); the refused
fields; the field table against transformers' configs; a save/load round trip; FusedKV on top (cache halved,
incremental decode equal to the full forward) and the command line."""

import json

import pytest
import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    PreTrainedConfig,
)

from fusedkv import FusedKVForCausalLM
from fusedkv.cache import kv_cache_nbytes
from fusedkv.convert import UnsupportedField, convert_qwen3, family_for
from fusedkv.convert.deepseek import FIELDS
from fusedkv.convert.family import COMMON, METADATA
from fusedkv.generation import generate
from tests.model.test_decode import incremental_logits
from tests.test_cli import run_cli

VOCAB = 97
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}
# 4 layers, 4 heads of (16 nope + 8 rope) query/key channels and 16 value channels, a 24-channel latent;
# 8 routed experts of 16 channels.
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
            pad_token_id=0, bos_token_id=None, eos_token_id=None)
V3 = dict(n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5)
V2 = dict(n_shared_experts=2, first_k_dense_replace=1)
VARIANTS = {  # name -> (transformers class, config, max_shard_size)
    "v3-qlora-interleave-yarn-groups-sharded": (DeepseekV3ForCausalLM, {**V3, "rope_parameters": YARN}, "40KB"),
    "v3-fullq-rotatehalf-tied": (DeepseekV3ForCausalLM, {
        **V3, "q_lora_rank": None, "rope_interleave": False, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0,
        "norm_topk_prob": False, "tie_word_embeddings": True, "rope_parameters": {"rope_type": "default",
                                                                                 "rope_theta": 50000.0}}, None),
    "v3-dense-only-linear-rope": (DeepseekV3ForCausalLM, {
        **V3, "first_k_dense_replace": 4, "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0,
                                                              "factor": 2.0}}, None),
    "v2-greedy-fullq": (DeepseekV2ForCausalLM, {**V2, "q_lora_rank": None, "topk_method": "greedy"}, None),
    "v2-group-limited-yarn-bias-sharded": (DeepseekV2ForCausalLM, {
        **V2, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 1, "routed_scaling_factor": 16.0,
        "attention_bias": True, "rope_parameters": YARN}, "40KB"),
}


def build_checkpoint(path, name, **extra):
    """A tiny random transformers DeepSeek model of variant `name` (with `extra` config fields), saved by
    save_pretrained into `path`."""
    cls, overrides, shard = VARIANTS[name]
    torch.manual_seed(0)
    config = (DeepseekV3Config if cls is DeepseekV3ForCausalLM else DeepseekV2Config)(**{**BASE, **overrides, **extra})
    model = cls(config).eval()
    with torch.no_grad():
        for module in model.modules():  # a non-zero V3 correction bias, so that choosing on it is checked
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0.0, 0.2)
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return model


# Variants whose features the other three bring into the fast tier (a full-rank query: v3-fullq-rotatehalf-tied;
# dense layers: every V3 variant's first layer; the greedy routing: tests/model/test_moe.py): the full suite's.
FULL_SUITE_ONLY = {"v3-dense-only-linear-rope", "v2-greedy-fullq"}


@pytest.fixture(scope="module", params=[pytest.param(name, marks=pytest.mark.slow if name in FULL_SUITE_ONLY else ())
                                        for name in VARIANTS])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, build_checkpoint(path, request.param)


def left_padded(width=24, pad=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (2, width), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :pad], mask[0, :pad] = 0, 0
    return ids, mask


def test_vanilla_import_matches_transformers(checkpoint, tmp_path):
    name, src, reference = checkpoint
    if name.endswith("sharded"):
        assert (src / "model.safetensors.index.json").exists()
    ours = convert_qwen3(src, tmp_path / "out").eval()
    assert ours.config.kv_sharing == "vanilla" and ours.config.kv_lora_rank == 24
    ids, mask = left_padded()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as transformers' generate derives them
    with torch.no_grad():
        want = reference(ids, attention_mask=mask, position_ids=positions).logits
        got = ours(ids, attention_mask=mask, use_cache=False).logits
        real = mask.bool()
        assert (got - want)[real].abs().max() < 1e-5
        hf_tokens = reference.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
        ours_hf = ours.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
        ours_native = generate(ours, ids, 32, attention_mask=mask).tokens
    assert hf_tokens.shape == (2, ids.shape[1] + 32)
    assert torch.equal(ours_hf, hf_tokens)
    assert torch.equal(ours_native, hf_tokens)


def test_round_trip_and_fusedkv_plan(checkpoint, tmp_path):
    """The written checkpoint loads back with the same logits; FusedKV on MLA builds from it, holds half the
    latent cache, and its incremental decode equals its full forward."""
    name, src, _ = checkpoint
    vanilla = convert_qwen3(src, tmp_path / "vanilla").eval()
    loaded = FusedKVForCausalLM.from_pretrained(tmp_path / "vanilla").eval()
    fused = convert_qwen3(src, tmp_path / "fusedkv", kv_sharing="fusedkv").eval()
    assert tuple(fused.plan.storage_layers) == (0, 1)
    assert not hasattr(fused.model.layers[3].self_attn, "kv_a_proj_with_mqa")
    ids, mask = left_padded(width=20)
    width = 14
    with torch.no_grad():
        a = vanilla(ids, attention_mask=mask, use_cache=False).logits
        # The checkpoint round-trips bit for bit; the logits to float32 rounding, since the memory alignment of
        # tensors loaded from safetensors can change a CPU kernel's summation order (seen on an AMD EPYC).
        state = loaded.state_dict()
        assert all(torch.equal(t, state[k]) for k, t in vanilla.state_dict().items()) and len(state) == len(
            vanilla.state_dict())
        torch.testing.assert_close(loaded(ids, attention_mask=mask, use_cache=False).logits, a, rtol=0, atol=1e-5)
        full = fused(ids, attention_mask=mask, use_cache=False).logits
        steps, cache = incremental_logits(fused, ids, mask, width)
        _, vanilla_cache = incremental_logits(vanilla, ids, mask, width)
    real = mask.bool()
    assert (steps[0] - full[:, :width])[real[:, :width]].abs().max() < 1e-5
    for i, step in enumerate(steps[1:]):
        assert (step[:, -1] - full[:, width + i]).abs().max() < 1e-5
    assert kv_cache_nbytes(cache) * 2 == kv_cache_nbytes(vanilla_cache)
    # The uptraining path: the vanilla fusedkv import re-planned gives the same model as the direct conversion.
    replanned = convert_qwen3(tmp_path / "vanilla", tmp_path / "replanned", kv_sharing="fusedkv")
    assert replanned.config.to_dict() == fused.config.to_dict()
    direct = fused.state_dict()
    assert all(torch.equal(v, direct[k]) for k, v in replanned.state_dict().items()) and len(direct) == len(
        replanned.state_dict())


def test_field_table_covers_transformers_configs():
    """Every field of transformers' DeepseekV3Config / DeepseekV2Config is in the table (a field transformers
    adds later fails here until someone decides what it becomes)."""
    generic = set(PreTrainedConfig.__dataclass_fields__)
    for cls in (DeepseekV3Config, DeepseekV2Config):
        fields = set(cls.__dataclass_fields__) - generic
        assert fields - set(FIELDS) - METADATA - set(COMMON) == set(), cls.__name__


def saved_config(model_type: str) -> dict:
    cls = DeepseekV3Config if model_type == "deepseek_v3" else DeepseekV2Config
    overrides = V3 if model_type == "deepseek_v3" else V2
    return cls(**{**BASE, **overrides}).to_dict()


@pytest.mark.parametrize("model_type, change, field", [
    ("deepseek_v3", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ("deepseek_v3", {"hidden_act": "gelu"}, "hidden_act"),
    ("deepseek_v3", {"num_key_value_heads": 2}, "num_key_value_heads"),
    ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func"),
    ("deepseek_v3", {"topk_method": "greedy"}, "topk_method"),
    ("deepseek_v3", {"n_group": None}, "n_group"),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     "rope_parameters.rope_type"),
    ("deepseek_v2", {"norm_topk_prob": True}, "norm_topk_prob"),
    ("deepseek_v2", {"mlp_bias": True}, "mlp_bias"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method"),
    ("deepseek_v2", {"num_experts_per_tok": None}, "num_experts_per_tok"),
])
def test_refused_fields_name_the_field(model_type, change, field):
    hf = {**saved_config(model_type), **change}
    with pytest.raises(UnsupportedField) as err:
        family_for(hf).to_config(hf, "vanilla")
    assert err.value.field == field and f"config field {field}=" in str(err.value) and "\n" not in str(err.value)


def test_plans_that_do_not_apply_to_mla_are_refused():
    hf = saved_config("deepseek_v3")
    family = family_for(hf)
    with pytest.raises(ValueError, match="fusedkv-lite does not apply to MLA"):
        family.to_config(hf, "fusedkv-lite")
    with pytest.raises(ValueError, match=r"kv_sharing='fusedkv\+gqa': \+gqa halves the KV heads, which MLA"):
        family.to_config(hf, "fusedkv+gqa")


def test_mtp_layers_are_dropped(tmp_path):
    """DeepSeek-V3 checkpoints append multi-token-prediction layers after num_hidden_layers; as transformers
    does, the import leaves them out."""
    from safetensors.torch import load_file, save_file

    build_checkpoint(tmp_path, "v3-fullq-rotatehalf-tied")
    state = load_file(tmp_path / "model.safetensors")
    state.update({k.replace("layers.3.", "layers.4."): v.clone() for k, v in state.items() if ".layers.3." in k})
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = convert_qwen3(tmp_path, tmp_path / "out")
    assert len(model.model.layers) == 4


@pytest.mark.slow
def test_cli_converts_and_refuses(tmp_path):
    src = tmp_path / "src"
    build_checkpoint(src, "v2-greedy-fullq")
    done = run_cli("convert", str(src), str(tmp_path / "fused"), "--kv-sharing", "fusedkv")
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "fused" / "config.json").read_text())["kv_sharing"] == "fusedkv"
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "mlp_bias": True}))
    refused = run_cli("convert", str(src), str(tmp_path / "refused"))
    assert refused.returncode == 2 and "mlp_bias=True" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "refused").exists()


# The published config.json of DeepSeek-V3 (its fp8 quantization_config left out) and DeepSeek-V2-Lite: the
# older `rope_scaling` spelling, the keys only DeepSeek's own code reads, no weights needed.
DEEPSEEK_V3_JSON = dict(
    architectures=["DeepseekV3ForCausalLM"], attention_bias=False, attention_dropout=0.0, aux_loss_alpha=0.001,
    bos_token_id=0, eos_token_id=1, ep_size=1, first_k_dense_replace=3, hidden_act="silu", hidden_size=7168,
    initializer_range=0.02, intermediate_size=18432, kv_lora_rank=512, max_position_embeddings=163840,
    model_type="deepseek_v3", moe_intermediate_size=2048, moe_layer_freq=1, n_group=8, n_routed_experts=256,
    n_shared_experts=1, norm_topk_prob=True, num_attention_heads=128, num_experts_per_tok=8, num_hidden_layers=61,
    num_key_value_heads=128, num_nextn_predict_layers=1, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
    rms_norm_eps=1e-06, rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                      "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
    rope_theta=10000, routed_scaling_factor=2.5, scoring_func="sigmoid", seq_aux=True, tie_word_embeddings=False,
    topk_group=4, topk_method="noaux_tc", torch_dtype="bfloat16", transformers_version="4.33.1", use_cache=True,
    v_head_dim=128, vocab_size=129280)
DEEPSEEK_V2_LITE_JSON = {
    **DEEPSEEK_V3_JSON, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_size": 2048,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 64,
    "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6,
    "num_hidden_layers": 27, "num_key_value_heads": 16, "q_lora_rank": None, "routed_scaling_factor": 1.0,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "scoring_func": "softmax", "topk_group": 1, "topk_method": "greedy", "vocab_size": 102400}


@pytest.mark.parametrize("hf, expected", [
    (DEEPSEEK_V3_JSON, dict(mlp_only_layers=[0, 1, 2], num_experts=256, topk_method="noaux_tc", n_group=8,
                            topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=1536)),
    (DEEPSEEK_V2_LITE_JSON, dict(mlp_only_layers=[0], num_experts=64, topk_method="greedy", n_group=None,
                                 topk_group=None, norm_topk_prob=False, routed_scaling_factor=1.0, q_lora_rank=None)),
])
def test_published_configs_map_as_transformers_reads_them(hf, expected):
    """The published configs import; RoPE frequencies, their cos/sin scaling and MLA's softmax scale are
    transformers' own for them (YaRN with factor 40 and mscale_all_dim)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    from fusedkv.model.layers import rope_inv_freq
    from fusedkv.model.mla import softmax_scale

    config = family_for(hf).to_config(hf, "vanilla")
    assert {k: getattr(config, k) for k in expected} == expected
    assert config.rope_interleave and config.rope_parameters["rope_type"] == "yarn" and config.head_dim == 64
    hf_config = (DeepseekV3Config if hf["model_type"] == "deepseek_v3" else DeepseekV2Config).from_dict(
        {k: v for k, v in hf.items() if k != "model_type"})
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    ours_inv_freq, ours_scaling = rope_inv_freq(config)
    assert torch.equal(ours_inv_freq.float(), inv_freq) and ours_scaling == scaling  # 1.0: mscale == mscale_all_dim
    qk_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    assert softmax_scale(config, qk_dim) == yarn_apply_mscale(hf_config.rope_parameters, qk_dim**-0.5) != qk_dim**-0.5


def test_fusedkv_conversion_trains(tmp_path):
    """The FusedKV conversion is a starting point for training: a step in training mode has a finite loss, and
    the fusion weights, the routers and the shared experts get gradients (the correction bias is a buffer)."""
    build_checkpoint(tmp_path / "src", "v3-qlora-interleave-yarn-groups-sharded")
    model = convert_qwen3(tmp_path / "src", tmp_path / "out", kv_sharing="fusedkv").train()
    ids, mask = left_padded()
    out = model(ids, attention_mask=mask, labels=ids)
    assert torch.isfinite(out.loss) and out.aux_loss is not None
    out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    for name in ("model.layers.3.self_attn.fusion.k_weight", "model.layers.3.self_attn.fusion.v_weight",
                 "model.layers.3.mlp.gate.weight", "model.layers.3.mlp.shared_experts.up_proj.weight"):
        assert grads[name] is not None and grads[name].abs().sum() > 0, name
    assert "model.layers.3.mlp.gate.e_score_correction_bias" in model.state_dict()


def test_odd_layer_counts_convert_to_fusedkv(tmp_path):
    """DeepSeek-V3 (61 layers) and V2-Lite (27) have an odd layer count: the lower ceil(L/2) layers keep their
    latent cache (fusedkv.plan.split_point), the upper ones fuse layers 1 and (L+1)/2. A 5-layer V3 converts,
    holds 3/5 of vanilla's cache, and decodes incrementally as its full forward; a custom map still works."""
    build_checkpoint(tmp_path / "src", "v3-qlora-interleave-yarn-groups-sharded", num_hidden_layers=5)
    fused = convert_qwen3(tmp_path / "src", tmp_path / "fused", kv_sharing="fusedkv").eval()
    vanilla = convert_qwen3(tmp_path / "src", tmp_path / "vanilla").eval()
    assert tuple(fused.plan.storage_layers) == (0, 1, 2)
    assert all(fused.plan.layers[i].k_sources == (0, 2) for i in (3, 4))
    ids, mask = left_padded(width=20)
    with torch.no_grad():
        full = fused(ids, attention_mask=mask, use_cache=False).logits
        steps, cache = incremental_logits(fused, ids, mask, 14)
        _, vanilla_cache = incremental_logits(vanilla, ids, mask, 14)
    assert max((step[:, -1] - full[:, 14 + i]).abs().max() for i, step in enumerate(steps[1:])) < 1e-5
    assert kv_cache_nbytes(cache) * 5 == kv_cache_nbytes(vanilla_cache) * 3
    assert fused.config.kv_cache_fraction() == pytest.approx(vanilla.config.kv_cache_fraction() * 3 / 5)
    source_map = [{"layers": [4, 5], "k": [1, 2], "v": [1, 2], "k_fusion": "channel", "v_fusion": "channel"}]
    custom = convert_qwen3(tmp_path / "src", tmp_path / "custom", kv_sharing="custom", kv_source_map=source_map)
    assert tuple(custom.plan.storage_layers) == (0, 1, 2)


@pytest.mark.parametrize("hf, stored", [(DEEPSEEK_V3_JSON, 31), (DEEPSEEK_V2_LITE_JSON, 14)])
def test_published_odd_configs_take_every_mla_plan(hf, stored):
    """The published 61- and 27-layer configs map to FusedKV and YOCO with the lower (L+1)/2 layers stored."""
    for plan in ("fusedkv", "yoco"):
        config = family_for(hf).to_config(hf, plan)
        assert len(config.plan.storage_layers) == stored and config.plan.layers[-1].k_sources[-1] == stored - 1
