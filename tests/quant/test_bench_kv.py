"""`fusedkv bench --kv-bits`: each plan also decodes through the KIVI cache; its row reports the
measured bytes of that cache (equal to the closed form) next to the full-precision row."""

from fusedkv.cli import main
from fusedkv.config import FusedKVConfig
from fusedkv.quant import kivi_cache_nbytes
from fusedkv.speed.inference import BenchShape, format_table, run_inference_bench


def test_bench_rows_with_the_kivi_cache():
    shape = BenchShape(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16,
                       vocab_size=128)
    rows = run_inference_bench(shape, ["fusedkv"], [32], [1], new_tokens=3, repeats=1, include_hf=False,
                               kv_bits=(4, 2), kv_group=4, kv_residual=8)
    by_plan = {r["plan"]: r for r in rows}
    assert set(by_plan) == {"vanilla", "fusedkv", "vanilla+kivi4", "vanilla+kivi2", "fusedkv+kivi4", "fusedkv+kivi2"}
    cfg = FusedKVConfig(**vars(shape), kv_sharing="fusedkv")
    for bits in (4, 2):
        row = by_plan[f"fusedkv+kivi{bits}"]
        assert row["cache_bytes"] == kivi_cache_nbytes(cfg, 32 + 3 - 1, 1, bits, 4, 8)
        assert row["tpot_s"] > 0
    assert by_plan["fusedkv+kivi2"]["cache_bytes"] < by_plan["fusedkv+kivi4"]["cache_bytes"]
    assert by_plan["fusedkv+kivi4"]["cache_bytes"] < by_plan["fusedkv"]["cache_bytes"]
    assert "| fusedkv+kivi4 |" in format_table(rows)


def test_bench_refuses_unsupported_bits(capsys):
    assert main(["bench", "--plans", "fusedkv", "--kv-bits", "3", "--no-hf"]) == 2
    assert "supports 2 or 4 bits" in capsys.readouterr().err
