"""Wrong or late messages, and what a killed writer leaves (issue 41, defect 11), through the real CLI: the
examples `fusedkv memory --help` prints run; `memory --uptrain` refuses a plan past the source's context as
`uptrain` does; `bench --gpu-suite` without CUDA names a command that exists; a Hugging Face checkpoint
given where a fusedkv model is expected names `fusedkv convert`; `--distributed ddp` outside torchrun says
it runs one process; a conversion killed with SIGKILL leaves temporaries that the next one removes, while
a live writer's are kept."""

from __future__ import annotations

import os
import re
import shlex
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.reliability.conftest import assert_one_line_error


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A tiny Hugging Face Llama (context 8192, so the help's seq_len=4096 fits) with a tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.reliability.conftest import _save_tokenizer

    path = tmp_path_factory.mktemp("hf-llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=128, max_position_embeddings=8192)
                     ).save_pretrained(path)
    _save_tokenizer(path, 300)
    return path


def _help_examples(text: str) -> list[list[str]]:
    """The `fusedkv ...` lines of a help text's examples, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [shlex.split(line.split("#")[0])[1:] for line in joined.splitlines() if line.strip().startswith("fusedkv ")]


def _set_help() -> str:
    import argparse

    from fusedkv import cli as fusedkv_cli

    sub = next(a for a in fusedkv_cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return next(a.help for a in sub.choices["memory"]._actions if "--set" in a.option_strings)


def test_memory_help_examples_run(cli, llama):
    from fusedkv.train import memory_command

    examples = _help_examples(memory_command.EPILOG)
    assert len(examples) >= 5 and any("--uptrain" in e for e in examples)
    set_example = re.search(r"e\.g\. (--set \S+)", _set_help()).group(1)
    examples.append(["memory", "--preset", "tiny", "--gpus", "1", *set_example.split()])
    for args in examples:
        args = [str(llama) if a == "my-llama/" else a for a in args]
        r = cli(*args)
        assert r.returncode == 0, (args, r.stderr[-1000:])
        assert "GiB" in r.stdout or "GB" in r.stdout, (args, r.stdout[-500:])


def test_a_decimal_batch_that_is_not_whole_sequences_names_the_nearest(cli):
    r = cli("memory", "--preset", "tiny", "--gpus", "1", "--set", "global_batch_tokens=1M", "--set", "seq_len=4096")
    assert_one_line_error(r, 2, "multiple of seq_len=4096", "999424", "1Mi")


def test_memory_uptrain_refuses_a_plan_past_the_source_context(cli, llama):
    r = cli("memory", "--uptrain", llama, "--gpus", "8", "--set", "seq_len=16384", "--set", "global_batch_tokens=1Mi")
    assert_one_line_error(r, 2, "seq_len=16384 is past the context", "8192 tokens")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the case is a machine without CUDA")
def test_bench_gpu_suite_without_cuda_names_a_command_that_exists(cli):
    r = cli("bench", "--gpu-suite")
    line = assert_one_line_error(r, 2, "needs CUDA", "python -m fusedkv.speed.gpu_suite --dry-run")
    assert "use --dry-run" not in line
    assert cli("bench", "--dry-run").returncode == 2  # what the old message advised: bench has no such flag


def test_a_hugging_face_checkpoint_where_a_fusedkv_model_is_expected_names_convert(cli, llama):
    r = cli("generate", llama, "--prompt", "hi", "--max-new-tokens", "1")
    assert_one_line_error(r, 2, "'llama' model", f"fusedkv convert {llama} OUT_DIR --plan PLAN")


def test_ddp_outside_torchrun_says_it_runs_one_process(capfd):
    from fusedkv.train import distributed as D

    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    for k in saved:
        os.environ.pop(k, None)
    try:
        env = D.setup("ddp", "cpu")
        try:
            assert env.world_size == 1
        finally:
            D.teardown(env)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    err = capfd.readouterr().err
    assert "outside torchrun runs one process" in err and "torchrun --nproc_per_node=N" in err


# ---- temporaries of a killed writer ------------------------------------------------------------------------
def _start_writer(dst: Path) -> int:
    """A forked process in the middle of writing `dst` (write_directory_atomically), left sleeping; its pid."""
    from fusedkv.model_dirs import write_directory_atomically

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: write, say so, sleep until killed
        try:
            os.close(r)

            def write(tmp):
                (tmp / "model.safetensors").write_bytes(b"x" * 1000)
                os.write(w, b"1")
                time.sleep(600)

            write_directory_atomically(dst, write)
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.close(r)
    return pid


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name)


def test_a_killed_conversion_leaves_temporaries_the_next_one_removes(cli, qwen3_src, tmp_path):
    dst = tmp_path / "converted"
    _kill(_start_writer(dst))
    left = _leftovers(tmp_path)
    assert len(left) == 2 and any(n.endswith(".lock") for n in left)  # the temporary and its lock
    live = _start_writer(tmp_path / "other")  # another destination's live writer: not ours to touch
    try:
        r = cli("convert", qwen3_src, dst, "--plan", "vanilla")
        assert r.returncode == 0, r.stderr[-2000:]
        assert not [n for n in _leftovers(tmp_path) if n.startswith(".converted.")]
        assert (dst / "config.json").is_file()
        assert len([n for n in _leftovers(tmp_path) if n.startswith(".other.")]) == 2
        # a live writer of the same destination is left alone too
        same = _start_writer(dst)
        try:
            from fusedkv.model_dirs import remove_dead_temporaries

            assert remove_dead_temporaries(dst) == []
            assert len([n for n in _leftovers(tmp_path) if n.startswith(".converted.")]) == 2
        finally:
            _kill(same)
        assert len(remove_dead_temporaries(dst)) == 1 and not [n for n in _leftovers(tmp_path)
                                                               if n.startswith(".converted.")]
    finally:
        _kill(live)
