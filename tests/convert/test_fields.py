"""The guard of every import: each family reads every field of its transformers config and refuses, with one
line naming the field, what fusedkv cannot reproduce (`UnsupportedField`); nothing is imported approximately.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from fusedkv.convert import FAMILIES, UnsupportedField, family_for
from fusedkv.convert.deepseek import FIELDS as DEEPSEEK_FIELDS
from fusedkv.convert.family import COMMON, METADATA, FieldTable
from fusedkv.convert.gemma import GEMMA2, GEMMA3
from fusedkv.convert.llama import LLAMA
from fusedkv.convert.mistral import MISTRAL
from fusedkv.convert.qwen2 import QWEN2
from fusedkv.convert.qwen3 import QWEN3, QWEN3_MOE

TABLES = [QWEN3, QWEN3_MOE, LLAMA, MISTRAL, QWEN2, GEMMA2, GEMMA3]
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


@pytest.mark.parametrize("table", TABLES, ids=[t.config_class for t in TABLES])
def test_the_table_covers_every_field_of_the_transformers_config(table: FieldTable):
    """A field transformers adds to the family's config fails here until the table says what it does."""
    fields = set(getattr(transformers, table.config_class)().to_dict())
    assert fields - table.known() == set()


@pytest.mark.parametrize("table", TABLES, ids=[t.config_class for t in TABLES])
def test_the_default_config_of_each_family_imports(table: FieldTable):
    cls = getattr(transformers, table.config_class)
    hf = cls(**SMALL).to_dict()
    config = family_for(hf).to_config(hf, "vanilla")
    assert config.num_hidden_layers == 2 and config.hidden_act in ("silu", "gelu_pytorch_tanh")


def test_every_family_is_listed_with_a_transformers_class():
    for family in FAMILIES:
        assert family.transformers_class and family.model_types


REFUSED = [
    ("llama", dict(hidden_act="gelu_10"), "hidden_act"),
    ("llama", dict(hidden_act="prelu"), "hidden_act"),
    ("llama", dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                    "long_factor": [1.0] * 8, "original_max_position_embeddings": 32}),
     "rope_parameters"),
    ("llama", dict(quantization_config={"quant_method": "gptq"}), "quantization_config"),
    ("llama", dict(some_future_switch=True), "some_future_switch"),
    ("qwen2", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "rope_parameters"),
    ("mistral", dict(hidden_act="xielu"), "hidden_act"),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=16), "use_sliding_window"),
    ("qwen3_moe", dict(hidden_act="gelu"), "hidden_act"),
    ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("gemma2", dict(hidden_activation="gelu_10"), "hidden_act"),
]


@pytest.mark.parametrize("model_type,fields,named", REFUSED, ids=[f"{r[0]}-{r[2]}" for r in REFUSED])
def test_a_field_fusedkv_cannot_reproduce_is_refused_naming_it(model_type, fields, named):
    hf = {"model_type": model_type, **SMALL, **fields}
    with pytest.raises(UnsupportedField, match=f"^config field {named}") as e:
        family_for(hf).to_config(hf, "vanilla")
    assert e.value.field == named and "\n" not in str(e.value)


def test_a_window_as_long_as_the_context_is_full_attention():
    hf = {"model_type": "mistral", **SMALL, "sliding_window": 64}
    config = family_for(hf).to_config(hf, "vanilla")
    assert config.layer_types == ["full_attention"] * 2 and config.sliding_window is None


def test_metadata_fields_are_only_bookkeeping():
    assert not METADATA & {"hidden_act", "rope_parameters", "sliding_window", "attention_bias"}


def test_imported_features_are_served_and_run_by_the_native_step():
    """An imported Llama (no QK-norm, llama3 RoPE) needs block features beyond Qwen3's; the vLLM plugin serves
    them (tests/serving/test_vllm_families.py) and the native CPU decode step runs them once the weights are
    in its layout (tests/engine/test_native_step_coverage.py checks its tokens)."""
    from fusedkv import FusedKVForCausalLM
    from fusedkv.engine.native_step import unsupported
    from fusedkv.engine.selection import set_decode_layout
    from fusedkv.serving.plugin import check_servable

    hf = transformers.LlamaConfig(**SMALL, rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}).to_dict()
    config = family_for(hf).to_config(hf, "vanilla")
    assert config.extra_block_features() == ["use_qk_norm", "rope_parameters"]
    check_servable(config)  # served by the vLLM plugin
    model = FusedKVForCausalLM(config).eval()
    keys = {i: torch.zeros(1, 2, 8, 16) for i in range(2)}
    assert "packed decode layout" in unsupported(model, keys, dict(keys), 1)  # row-major weights: not yet
    assert unsupported(set_decode_layout(model, "packed"), keys, dict(keys), 1) is None
    hf = transformers.Qwen3Config(**SMALL).to_dict()
    assert family_for(hf).to_config(hf, "vanilla").extra_block_features() == []


# Fields real Hub configs carry (issue 41, defect 7), with the values they ship with: none changes the function.
SHIPPED_METADATA = dict(
    use_mrope=False, unk_token_id=0, sep_token_id=None, cls_token_id=None, mask_token_id=None,
    decoder_start_token_id=None, torchscript=False, use_bfloat16=False, tf_legacy_loss=False, pruned_heads={},
    is_decoder=False, add_cross_attention=False, cross_attention_hidden_size=None, tie_encoder_decoder=False,
    _attn_implementation_autoset=True, model_name="SmolLM2-135M", _model_name_or_path="Smollm2 135M 8k",
    quantization_config=None)
DEEPSEEK_SMALL = dict(SMALL, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                      qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                      topk_group=1, moe_intermediate_size=32, first_k_dense_replace=1)
MODEL_TYPES = ["qwen3", "qwen3_moe", "llama", "mistral", "qwen2", "gemma2", "gemma3_text", "deepseek_v3",
               "deepseek_v2"]


def small(model_type: str, **fields) -> dict:
    return {"model_type": model_type, **(DEEPSEEK_SMALL if model_type.startswith("deepseek") else SMALL), **fields}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_metadata_that_real_configs_carry_is_accepted(model_type):
    plain = family_for(small(model_type)).to_config(small(model_type), "vanilla")
    hf = small(model_type, **SHIPPED_METADATA)
    assert family_for(hf).to_config(hf, "vanilla").to_dict() == plain.to_dict()


COMPUTES = [("use_mrope", True), ("is_decoder", True), ("add_cross_attention", True), ("pruned_heads", {0: [1]}),
            ("quantization_config", {"quant_method": "gptq", "bits": 4}),
            ("quantization_config", {"quant_method": "fp8", "fmt": "e4m3"})]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma3_text", "deepseek_v3"])
@pytest.mark.parametrize("name, value", COMPUTES, ids=[f"{n}-{v}" for n, v in COMPUTES])
def test_a_switch_that_changes_the_computation_is_refused_with_a_fix(model_type, name, value):
    hf = small(model_type, **{name: value})
    with pytest.raises(UnsupportedField, match=f"^config field {name}=") as e:
        family_for(hf).to_config(hf, "vanilla")
    assert e.value.field == name and "\n" not in str(e.value)
    assert str(e.value).endswith("; " + COMMON[name].fix)  # the reason, then the fix


def test_the_record_a_gguf_load_leaves_is_accepted():
    """transformers' GGUF loader records quant_method gguf; the weights it saves are already dequantised floats."""
    hf = small("llama", quantization_config={"quant_method": "gguf", "gguf_file": "m.gguf", "dequantize": False})
    family_for(hf).to_config(hf, "vanilla")


def test_every_field_is_classified_once():
    """A field is metadata (accepted), a common switch (COMMON) or a family's own: never two of these."""
    assert not METADATA & set(COMMON)
    for table in TABLES:
        assert not set(table.fields) & (METADATA | set(COMMON)), table.family
    assert not set(DEEPSEEK_FIELDS) & (METADATA | set(COMMON))
