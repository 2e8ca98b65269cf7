"""`fusedkv serve` refuses, before vLLM starts, everything vLLM would refuse late or run wrong: one line,
exit 2, no "starting vLLM" line, within seconds. The vLLM environment is needed only for its probe
(these tests start no server)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess

import pytest

from fusedkv.serving import preflight
from tests import _cli as cli_process
from tests.serving.conftest import REPO, vllm_env


def torch_cpu_runs_fp8() -> bool:
    import torch

    return torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


def serve(*args: str) -> cli_process.Result:
    return cli_process.fusedkv("serve", *args, cwd=REPO, env=vllm_env(), timeout=120)


def refused(r: subprocess.CompletedProcess, *words: str) -> str:
    """Exit 2 with exactly one line, naming `words`, and vLLM never started."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("fusedkv serve: error: "), r.stderr[-3000:]
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def ckpt(vllm_python, checkpoints):
    return str(checkpoints["fusedkv"])


def test_head_size_the_cpu_backend_cannot_run_is_refused(vllm_python, tmp_path):
    from tiny_checkpoints import write_checkpoints

    path = write_checkpoints(tmp_path, plans=("fusedkv",), head_dim=16)["fusedkv"]  # `--preset nano`'s head_dim
    refused(serve(str(path)), "head_dim=16", "Unsupported CPU attention configuration")  # vLLM's kernels' own words


@pytest.mark.slow  # a vLLM engine in the session's worker
def test_head_dim_48_as_fusedkv_train_makes_it_is_served(vllm_python, vllm_workers, tmp_path):
    """Issue 41 defect 6: vLLM's CPU backend does not list head size 48 but runs it (its "vec16" kernels); the
    preflight asks the kernels, and the model `fusedkv train` makes by default (head_dim 48) serves with the
    transformers model's greedy tokens."""
    from tiny_checkpoints import reference_outputs, write_checkpoints

    from fusedkv import FusedKVConfig
    from tests.serving.conftest import run_offline

    path = write_checkpoints(tmp_path, plans=("fusedkv",), head_dim=48)["fusedkv"]
    config = FusedKVConfig.from_pretrained(path)
    preflight.check_cpu_backend(config, None, vllm_python, vllm_env())  # does not raise
    ref = reference_outputs(path)
    (tmp_path / "run").mkdir()
    got = run_offline(vllm_workers, [path], [row["prompt_ids"] for row in ref["rows"]], tmp_path / "run")[0]
    assert [g["tokens"] for g in got["rows"]] == [r["tokens"] for r in ref["rows"]]


def test_imported_family_features_are_served():
    """The features of the imported dense families (biases, no QK-norm, scaled RoPE, Gemma's norms and
    scalings, windows) pass the plugin's check (served: tests/serving/test_vllm_families.py)."""
    from tiny_checkpoints import tiny_config

    from fusedkv.serving.plugin import check_servable

    for plan in ("vanilla", "fusedkv", "fusedkv-lite"):
        config = tiny_config(plan, 320, attention_bias=True, mlp_bias=True, use_qk_norm=False,
                             rms_norm_unit_offset=True, use_post_norms=True, embedding_multiplier=11.0,
                             hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=24, final_logit_softcapping=30.0,
                             sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
                             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                 "rope_theta": 1e6},
                                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
        assert config.extra_block_features()
        check_servable(config)
    # Gemma 2's soft cap: vLLM's op applies it to one-source layers, the gathered path to fused K sources
    # (served: gemma2/fusedkv in tests/serving/test_vllm_families.py).
    for plan in ("fusedkv-lite", "fusedkv"):
        check_servable(tiny_config(plan, 320, attn_logit_softcapping=5.0))


def test_block_size_the_cpu_backend_cannot_run_is_refused(ckpt):
    refused(serve(ckpt, "--block-size", "48"), "--block-size 48", "multiple of 32")


def test_port_in_use_is_refused(ckpt):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        refused(serve(ckpt, "--port", str(port)), f"port {port}", "in use")


@pytest.mark.parametrize("host,words", [("no-such-host.invalid", ("--host", "resolve")),
                                        ("192.0.2.1", ("--host 192.0.2.1", "not an address of this machine"))])
def test_bad_or_foreign_host_is_refused(ckpt, host, words):
    refused(serve(ckpt, "--host", host), *words)


@pytest.mark.parametrize("extra", [["--port", "9999"], ["--port=9999"], ["--dtype", "bfloat16"],
                                   ["--max_model_len", "64"], ["--no-enforce-eager"], ["--model", "x"]])
def test_vllm_options_that_fusedkv_sets_are_refused_after_the_separator(ckpt, extra):
    refused(serve(ckpt, "--port", "9000", "--", "--api-key", "k", *extra), repr(extra[0]), "duplicates")


def test_fast_prefill_is_fusedkv_serves_own_option(ckpt):
    """vLLM's flag needs eager mode with FusedKV (a data-dependent subset of positions): `--skip-prefill` sets
    both, so the flag after `--` is a duplicate, refused before start-up."""
    refused(serve(ckpt, "--", "--kv-sharing-fast-prefill"), "--kv-sharing-fast-prefill", "--skip-prefill")


def test_skip_prefill_on_a_plan_without_skippable_layers_is_refused(checkpoints):
    refused(serve(str(checkpoints["vanilla"]), "--skip-prefill"), "--skip-prefill", "vanilla", "no layer to skip")


@pytest.mark.parametrize("extra,words", [(["-tp", "3"], ("--tensor-parallel-size 3", "does not divide")),
                                         (["-pp", "2"], ("--pipeline-parallel-size 2", "pipeline parallel size 1"))])
def test_options_the_plugin_cannot_run_are_refused(ckpt, extra, words):
    refused(serve(ckpt, "--", *extra), *words)


@pytest.mark.skipif(torch_cpu_runs_fp8(), reason="vLLM's CPU build runs fp8 caches on processors with AVX-512 or AMX")
def test_fp8_cache_is_refused_where_vllms_cpu_build_cannot_run_it(ckpt):
    """FusedKV reads fp8 caches (tests/serving/test_fp8_paged_cache.py); on this processor vLLM's CPU kernels do not,
    which its own words say before start-up."""
    refused(serve(ckpt, "--", "--kv-cache-dtype", "fp8"), "--kv-cache-dtype fp8", "AVX-512 or AMX")


MLA = dict(kv_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, head_dim=16)


@pytest.fixture(scope="module")
def mla_ckpt(vllm_python, tmp_path_factory):
    from tiny_checkpoints import write_checkpoints

    return str(write_checkpoints(tmp_path_factory.mktemp("mla"), plans=("vanilla",), **MLA)["vanilla"])


def test_mla_latents_are_not_quantised(mla_ckpt):
    """MLA's head_dim (the RoPE width, 16 here) is not a vLLM attention head: not refused as one; an fp8
    cache is refused (the plugin's MLA layers keep their latents unquantised), even for vanilla."""
    refused(serve(mla_ckpt, "--", "--kv-cache-dtype", "fp8"), "--kv-cache-dtype fp8", "MLA", "unquantised")


def test_moe_and_mla_models_are_servable():
    """What issue 26 added to the plugin is no longer refused; what it cannot take still is."""
    from tiny_checkpoints import tiny_config

    from fusedkv.serving.plugin import check_servable

    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
               topk_method="noaux_tc", n_group=4, topk_group=2, routed_scaling_factor=2.5)
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
            "mscale_all_dim": 0.707}
    check_servable(tiny_config("fusedkv", 320, **moe))
    check_servable(tiny_config("fusedkv", 320, **MLA, **moe, rope_parameters=yarn))
    check_servable(tiny_config("fusedkv", 320, rope_parameters=yarn))  # scaled RoPE in multi-head attention too
    with pytest.raises(ValueError, match="dynamic"):
        check_servable(tiny_config("fusedkv", 320, **MLA, rope_parameters={
            "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}))


def test_nan_weights_are_refused(ckpt, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "nan"
    shutil.copytree(ckpt, bad)
    tensors = load_file(bad / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name][0, 0] = float("nan")
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    assert torch.isnan(load_file(bad / "model.safetensors")[name]).any()
    refused(serve(str(bad)), "non-finite weights", name)


def test_auto_dtype_is_the_checkpoints_and_lower_precision_is_warned(checkpoints):
    from fusedkv import FusedKVConfig

    config = FusedKVConfig.from_pretrained(checkpoints["fusedkv"])
    assert preflight.resolve_dtype("auto", config) == ("float32", None)
    dtype, warning = preflight.resolve_dtype("bfloat16", config)
    assert dtype == "bfloat16" and "float32 checkpoint in bfloat16" in warning and "--dtype float32" in warning
    assert preflight.resolve_dtype("float32", config) == ("float32", None)


@pytest.mark.slow  # imports vLLM in its own environment
def test_cpu_limits_are_the_installed_vllms(vllm_workers):
    """The block multiple `fusedkv serve` checks against, read from vLLM's CPU backend itself (head sizes are asked
    of its kernels at every start: `cpu_probe`)."""
    probe = ("import json; from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend as B; "
             "print(json.dumps([getattr(b, 'base', b) for b in B.get_supported_kernel_block_sizes()]))")
    r = vllm_workers.run(code=probe, timeout=300)
    assert r["rc"] == 0, r["error"]
    block_sizes = json.loads(r["stdout"].strip().splitlines()[-1])
    assert block_sizes == [preflight.CPU_BLOCK_MULTIPLE]


def test_the_reason_a_server_died_is_the_root_cause_in_vllms_output():
    """Lines as vLLM 0.32 printed them when its CPU attention refused head_dim 16 at the first request."""
    from fusedkv.serving.supervisor import Server

    server = Server([], {}, "", None)
    for line in [
        "(Worker pid=12019) ERROR 12-01 15:50:24 [multiproc_executor.py:1063] Traceback (most recent call last):",
        "(Worker pid=12019) ERROR 12-01 15:50:24 [multiproc_executor.py:1063] RuntimeError: Unsupported CPU "
        "attention configuration: head_dim=16 isa=2 kv_cache_idx=0",
        "(EngineCore pid=11225) ERROR 12-01 15:50:24 [core.py:1512] RuntimeError: Worker failed with error "
        "'Unsupported CPU attention configuration', please check the stack trace above for the root cause",
        "(APIServer pid=10112) ERROR 12-01 15:50:24 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
        "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        "INFO:     Shutting down",
    ]:
        server.tail.append(line)
    assert server.reason() == ("RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2 "
                               "kv_cache_idx=0")
    server.tail.clear()
    server.tail.extend(["usage: api_server.py [-h] ...", "api_server.py: error: unrecognized arguments: --bogus"])
    assert server.reason() == "api_server.py: error: unrecognized arguments: --bogus"


def test_gpu_hybrids_that_read_other_layers_get_one_block_table():
    """vLLM's hybrid KV-cache manager (GPU builds) may give window and full layers separate block tables; a
    reconstruction layer reads its sources through its own, so fusedkv serve disables the manager for them."""
    from tiny_checkpoints import tiny_config

    hybrid = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2)
    flag = ["--disable-hybrid-kv-cache-manager"]
    assert preflight.implied_vllm_args(tiny_config("fusedkv", 320, **hybrid), [], cpu_build=False) == flag
    # Lite's hybrid plan reuses a layer of the same attention type as it is: vLLM's own KV sharing, no table read.
    assert preflight.implied_vllm_args(tiny_config("fusedkv-lite", 320, **hybrid), [], cpu_build=False) == []
    assert preflight.implied_vllm_args(tiny_config("fusedkv", 320, **hybrid), [], cpu_build=True) == []  # one group
    assert preflight.implied_vllm_args(tiny_config("fusedkv", 320), [], cpu_build=False) == []  # no windows
    assert preflight.implied_vllm_args(tiny_config("vanilla", 320, **hybrid), [], cpu_build=False) == []
    assert preflight.implied_vllm_args(tiny_config("fusedkv", 320, **hybrid), flag, cpu_build=False) == []  # given
