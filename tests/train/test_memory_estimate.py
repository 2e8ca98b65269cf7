"""The memory plan (`fusedkv plan-run`) against the real peak of a training step on CPU.

`measure_peak_cpu` profiles a steady-state step (forward and backward over every micro-batch, clipping,
AdamW) with torch's memory profiler; the plan must be within 10% of it. nano runs here; tiny (a few
seconds more per case) is a manual test (`pytest --run-manual`)."""

from __future__ import annotations

import pytest

from fusedkv.cli import main
from fusedkv.train import TrainConfig
from fusedkv.train import memory_estimate as M
from fusedkv.train.memory_measure import measure_peak_cpu, relative_error, single_process_estimate


def _check(preset: str, checkpointing: bool):
    cfg = TrainConfig(preset=preset, data="builtin", progress=False)
    measured = measure_peak_cpu(cfg, checkpointing=checkpointing)
    plan = single_process_estimate(cfg, checkpointing=checkpointing)
    err = relative_error(plan.peak, measured["peak"])
    assert err < 0.10, f"{preset} ckpt={checkpointing}: plan {plan.peak:,.0f} B vs measured {measured['peak']:,.0f} B"
    # The parts the profiler attributes line up with the plan's components too.
    cats = measured["by_category"]
    assert cats["parameter"] == pytest.approx(plan.weights, rel=0.01)
    assert cats["optimizer_state"] == pytest.approx(plan.optimizer, rel=0.01)
    return plan, measured


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_plan_matches_measured_peak_nano(checkpointing):
    _check("nano", checkpointing)


@pytest.mark.manual
@pytest.mark.parametrize("checkpointing", [False, True])
def test_plan_matches_measured_peak_tiny(checkpointing):
    plan, _ = _check("tiny", checkpointing)
    # tiny's peak is the loss backward: activations and the T x V buffers dominate the 3.3M parameters.
    assert plan.peak == plan.peak_backward


def test_parameter_count_is_exact():
    from fusedkv.model import FusedKVForCausalLM

    cfg = TrainConfig(preset="nano", data="builtin", progress=False)
    mc = M.model_config(cfg)
    counted = M.count_parameters(mc)
    assert counted.total == sum(p.numel() for p in FusedKVForCausalLM(mc).parameters())


def test_checkpointing_and_sharding_shrink_the_plan():
    cfg = TrainConfig(preset="1.5b", progress=False)
    plan = M.estimate_run(cfg, gpus=16, gpu_memory=80e9)
    ddp, fsdp = plan.estimates["ddp", False], plan.estimates["fsdp", False]
    assert fsdp.weights * 16 == pytest.approx(ddp.weights)
    assert fsdp.optimizer * 16 == pytest.approx(ddp.optimizer)
    assert plan.estimates["fsdp", True].activations < fsdp.activations / 4
    # The KV cache is the plan's: FusedKV keeps half of vanilla's.
    assert plan.kv_bytes_per_token * 2 == plan.kv_bytes_per_token_vanilla


def test_cli_4b(capsys):
    assert main(["plan-run", "--preset", "4b", "--gpus", "64", "--gpu-memory", "80GB",
                 "--tokens-per-gpu-s", "3000"]) == 0
    out = capsys.readouterr().out
    assert "FSDP (full shard) + act. ckpt" in out and "verdict: fits with" in out
    assert "days for the budget" in out


@pytest.mark.parametrize("argv, needle", [
    (["--gpus", "0"], "--gpus"),
    (["--gpu-memory", "80XB"], "memory size"),
    (["--preset", "4b", "--gpus", "7"], "does not split into 7 ranks"),
    (["--tokens-per-gpu-s", "-1"], "--tokens-per-gpu-s"),
])
def test_cli_bad_input(capsys, argv, needle):
    try:
        code = main(["plan-run", *argv])
    except SystemExit as e:  # flags are range-checked while parsing (fusedkv.argtypes)
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def nano_teacher(tmp_path_factory):
    """A saved vanilla nano model, the teacher of an uptraining run; and the student: it converted to FusedKV."""
    import json

    import torch

    from fusedkv.model import FusedKVForCausalLM
    from fusedkv.train.distill import teacher_student_configs

    cfg = TrainConfig(preset="nano", data="builtin", progress=False)
    path = tmp_path_factory.mktemp("teacher")
    torch.manual_seed(0)
    FusedKVForCausalLM(M.model_config(cfg.replace(kv_sharing="vanilla"))).save_pretrained(path)
    teacher, student = teacher_student_configs(json.loads((path / "config.json").read_text()), "fusedkv")
    return path, teacher, student


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing,hidden", [(False, 0.0), (True, 0.0), (False, 0.5)])
def test_uptraining_plan_matches_measured_peak_nano(nano_teacher, checkpointing, hidden):
    """The teacher's weights, the KL's log-probabilities (and hidden states) against a measured step of
    distillation: within 10%, and the teacher's share is really there (the plan without it is off)."""
    path, teacher_cfg, student = nano_teacher
    cfg = TrainConfig(preset="nano", data="builtin", progress=False, distill_hidden_weight=hidden)
    measured = measure_peak_cpu(cfg, checkpointing, model=student, teacher=str(path))["peak"]
    teacher = M.count_teacher(path, teacher_cfg, "float32", hidden=hidden > 0)
    plan = single_process_estimate(cfg, checkpointing, model=student, teacher=teacher)
    assert relative_error(plan.peak, measured) < 0.10, (plan.peak, measured)
    without = single_process_estimate(cfg, checkpointing, model=student)
    assert relative_error(without.peak, measured) > 0.15
    assert plan.teacher_weights == 4 * teacher.params.total


def test_cli_uptrain_counts_the_teacher(nano_teacher, capsys):
    path = nano_teacher[0]
    assert main(["memory", "--uptrain", str(path), "--plan", "fusedkv-lite", "--gpus", "2", "--gpu-memory", "1GB",
                 "--preset", "nano"]) == 0
    out = capsys.readouterr().out
    assert "teacher FusedKVForCausalLM" in out and "teacher weights (every GPU)" in out
    assert "plan fusedkv-lite" in out and "+ the teacher's forward" in out
    assert main(["plan-run", "--preset", "nano"]) == 0  # the former name still works


def test_mixture_of_experts_and_latent_attention_are_counted():
    """MoE and MLA models are planned (no longer refused): more activations than a dense model with one
    expert's width, and the FLOPs count only the experts a token visits."""
    cfg = TrainConfig(preset="nano", data="builtin", progress=False)
    dense = M.model_config(cfg)
    moe = M.model_config(cfg.replace(model={**cfg.model, "num_experts": 8, "num_experts_per_tok": 2,
                                            "moe_intermediate_size": 32}))
    mla = M.model_config(cfg.replace(model={**cfg.model, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                                            "qk_rope_head_dim": 8, "v_head_dim": 16}))
    for mc in (moe, mla):
        assert M.activation_bytes_per_token(mc)["total"] > 0
    p = M.count_parameters(moe)
    assert p.active < p.non_embedding
    plan = M.estimate_run(cfg, gpus=1, gpu_memory=80e9, model=mla)
    assert plan.estimates["fsdp", False].peak > 0 and plan.mc.kv_lora_rank == 32
    assert M.count_parameters(dense).active == M.count_parameters(dense).non_embedding
