"""The inference benchmark and the GPU benchmark run end to end at tiny sizes (correctness of the
machinery, not speed: speed lives in docs/results.md); the GPU benchmark fails when a kernel is wrong."""

import json

import pytest

from fusedkv.cli import main
from fusedkv.kernels import decode_attention
from fusedkv.speed.gpu_suite import main as gpu_suite_main
from fusedkv.speed.inference import BenchShape, format_table, run_inference_bench


def test_inference_bench_rows_and_ratios(tmp_path):
    shape = BenchShape(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16,
                       vocab_size=128)
    rows = run_inference_bench(shape, ["fusedkv-lite", "fusedkv", "gqa"], [32], [1], new_tokens=3, repeats=1)
    by_plan = {r["plan"]: r for r in rows}
    assert set(by_plan) == {"vanilla", "fusedkv-lite", "fusedkv", "gqa", "hf-qwen3"}
    for plan in ("fusedkv-lite", "fusedkv", "gqa"):
        assert by_plan[plan]["cache_ratio"] == 0.5
        assert by_plan[plan]["context_at_budget_ratio"] == 2.0
    assert by_plan["vanilla"]["ttft_ratio"] == 1.0
    assert by_plan["fusedkv"]["tpot_byte_floor"] > by_plan["fusedkv-lite"]["tpot_byte_floor"]
    assert "| fusedkv |" in format_table(rows)


def test_bench_cli_writes_json_and_plot(tmp_path):
    args = ["bench", "--plans", "fusedkv", "--prompt-lens", "16,32", "--batch-sizes", "1", "--new-tokens", "2",
            "--repeats", "1", "--layers", "2", "--hidden", "32", "--heads", "2", "--head-dim", "16", "--vocab", "64",
            "--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")]
    assert main(args) == 0
    assert len(json.loads((tmp_path / "b.json").read_text())) == 6  # 3 models x 2 lengths
    assert (tmp_path / "b.png").exists()


@pytest.mark.slow
def test_gpu_benchmark_model_part_dry_run(capsys):
    assert gpu_suite_main(["--dry-run", "--skip-kernels"]) == 0
    out = capsys.readouterr().out
    assert "| GQA H_q=8 H_kv=2 | fusedkv | 64 |" in out and "cache vs MHA" in out


def _factored_decode(q, k_sources, k_weights, v_sources, v_weights, **kw):
    return decode_attention(q, k_sources, k_weights, v_sources, v_weights, kernel="torch")


def _wrong_decode(q, k_sources, k_weights, v_sources, v_weights, **kw):
    # The right computation with the softmax scale forgotten: plausible numbers, wrong ones.
    return decode_attention(q, k_sources, k_weights, v_sources, v_weights, scale=1.0, kernel="torch")


def test_gpu_benchmark_fails_when_a_timed_kernel_is_wrong(capsys):
    # The kernel part, run on CPU with a torch decode in place of Triton: a correct one passes, a wrong
    # one is reported and the benchmark exits 1 (so `fusedkv bench --gpu-suite` fails).
    assert gpu_suite_main(["--dry-run", "--skip-model"], kernel=_factored_decode) == 0
    assert "0 failed checks" in capsys.readouterr().out
    assert gpu_suite_main(["--dry-run", "--skip-model"], kernel=_wrong_decode) == 1
    captured = capsys.readouterr()
    assert "**WRONG**" in captured.out and "decode-kernel checks against the fp32 reference failed" in captured.err


@pytest.mark.slow
def test_inference_bench_on_a_sliding_window_hybrid():
    # Window storage layers hold W - 1 tokens in the static cache: the measured bytes say so, for the
    # hybrid itself and for FusedKV sharing window layers only (+W) or both types (+WF).
    shape = BenchShape(num_hidden_layers=8, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16,
                       vocab_size=128, sliding_window=8)
    assert shape.layer_types() == ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3 + [
        "full_attention"]
    rows = run_inference_bench(shape, ["fusedkv+W", "fusedkv+WF"], [40], [1], new_tokens=3, repeats=1)
    by_plan = {r["plan"]: r for r in rows}
    per_layer = 2 * 4 * 16 * 4  # K and V, 4 KV heads of 16, fp32, per token
    context = 40 + 3
    held = {"vanilla": 6 * 7 + 2 * context, "fusedkv+W": 3 * 7 + 2 * context, "fusedkv+WF": 3 * 7 + 1 * context}
    for plan, tokens in held.items():
        assert by_plan[plan]["cache_bytes"] == per_layer * tokens, plan
        assert abs(by_plan[plan]["cache_ratio"] - tokens / (8 * context)) < 1e-9
    assert by_plan["fusedkv+WF"]["tpot_byte_floor"] < by_plan["vanilla"]["tpot_byte_floor"] == 1.0


def test_inference_bench_on_moe_and_mla_models():
    # MoE: the cache is the attention plan's, whatever the MLP; no transformers Qwen3 row (another model).
    moe = BenchShape(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16,
                     vocab_size=128, architecture=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64))
    rows = {r["plan"]: r for r in run_inference_bench(moe, ["fusedkv"], [24], [1], new_tokens=2, repeats=1)}
    assert set(rows) == {"vanilla", "fusedkv"} and rows["fusedkv"]["cache_ratio"] == pytest.approx(0.5)
    # MLA: the cache holds the latent and the RoPE key per storage layer, never the expanded K/V.
    mla = BenchShape(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=4,
                     vocab_size=128, architecture=dict(kv_lora_rank=28, q_lora_rank=None, qk_rope_head_dim=4,
                                                       qk_nope_head_dim=12, v_head_dim=16))
    rows = {r["plan"]: r for r in run_inference_bench(mla, ["fusedkv"], [24], [2], new_tokens=2, repeats=1)}
    context, latent = 24 + 2, 28 + 4
    assert rows["vanilla"]["cache_bytes"] == 4 * latent * 4 * 2 * context  # layers x width x fp32 x batch x tokens
    assert rows["fusedkv"]["cache_bytes"] * 2 == rows["vanilla"]["cache_bytes"]
    assert rows["vanilla"]["cache_ratio"] == pytest.approx(latent / (4 * (12 + 4 + 16)))
    assert rows["fusedkv"]["tpot_byte_floor"] < 1.0


def test_bench_refuses_architectures_that_do_not_fit_before_measuring(capsys):
    assert main(["bench", "--mla-rank", "64", "--plans", "fusedkv-lite", "--layers", "4"]) == 2
    assert "fusedkv-lite does not apply to MLA" in capsys.readouterr().err
    assert main(["bench", "--experts", "4", "--experts-per-tok", "5"]) == 2
    assert "--experts-per-tok 5 is more than --experts 4" in capsys.readouterr().err
