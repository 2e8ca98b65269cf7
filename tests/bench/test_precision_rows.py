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
