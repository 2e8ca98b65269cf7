"""`fusedkv bench --precisions`: reduced-precision rows next to the f32 plans, with their cache bytes
and byte floors following the weight and KV widths."""

import torch

from fusedkv.speed.inference import BenchShape, run_inference_bench


def test_precision_rows_report_smaller_bytes():
    torch.manual_seed(0)
    shape = BenchShape(num_hidden_layers=2, hidden_size=64, intermediate_size=192, num_attention_heads=2,
                       head_dim=32, vocab_size=256)
    rows = run_inference_bench(shape, ["vanilla", "fusedkv-lite"], [16], [1], new_tokens=3, repeats=1,
                               include_hf=False, precisions=("float32/bfloat16", "int8/bfloat16"))
    by = {r["plan"]: r for r in rows}
    assert set(by) == {"vanilla", "fusedkv-lite", "vanilla w=f32 kv=bf16", "vanilla w=int8 kv=bf16",
                       "fusedkv-lite w=f32 kv=bf16", "fusedkv-lite w=int8 kv=bf16"}
    assert by["fusedkv-lite w=int8 kv=bf16"]["cache_bytes"] * 4 == by["vanilla"]["cache_bytes"]
    assert by["vanilla w=int8 kv=bf16"]["tpot_byte_floor"] < by["vanilla w=f32 kv=bf16"]["tpot_byte_floor"] < 1


def test_int4_rows_name_a_head_other_than_the_default():
    """int4/KV keeps the LM head at int8 (unnamed: the default); int4@int4/KV quantises it too, a row of its own
    that streams fewer weight bytes."""
    from fusedkv.speed.inference import build_models, precision_row

    shape = BenchShape(num_hidden_layers=1, hidden_size=64, intermediate_size=192, num_attention_heads=2,
                       head_dim=32, vocab_size=256)
    model = build_models(shape, ["vanilla"], 32, "cpu", torch.float32, include_hf=False)["vanilla"]
    (name8, m8, _), (name4, m4, _) = (precision_row(model, "vanilla", s) for s in ("int4/half", "int4@int4/half"))
    assert name8.startswith("vanilla w=int4 kv=") and name4.startswith("vanilla w=int4@int4 kv=")
    assert m8.lm_head.fmt == "int8" and m4.lm_head.fmt == "int4"
    assert m8.model.layers[0].mlp.down_proj.fmt == m4.model.layers[0].mlp.down_proj.fmt == "int4"
