"""`fusedkv prune`: the output directory is checked before any work and written atomically; a checkpoint
with non-finite weights is refused. Each case drives the real CLI in a child process."""

import hashlib
import shutil

import pytest

from tests.reliability.conftest import assert_one_line_error

FAST = ("--calib-seqs", "2", "--calib-len", "16", "--batch-size", "2")


def _digest(directory) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def test_out_holding_another_model_is_refused_before_any_work(cli, tiny_ckpt, tmp_path):
    """Was (#1): exit 0, the other trained model overwritten in place."""
    other = tmp_path / "other-run" / "final"
    shutil.copytree(tiny_ckpt, other)
    before = _digest(other)
    r = cli("prune", tiny_ckpt, "--sparsity", "0.5", "--out", other, *FAST)
    assert_one_line_error(r, 2, f"--out {other} already holds files (a model)", "--overwrite")
    assert "Wanda" not in r.stdout  # refused before loading and pruning
    assert _digest(other) == before
    assert sorted(p.name for p in other.parent.iterdir()) == ["final"]  # no temporary left


@pytest.mark.slow
def test_overwrite_replaces_the_model_whole(cli, tiny_ckpt, tmp_path):
    out = tmp_path / "pruned"
    shutil.copytree(tiny_ckpt, out)
    (out / "stale-file").write_text("from the old model")
    r = cli("prune", tiny_ckpt, "--sparsity", "0.5", "--out", out, "--overwrite", *FAST)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not (out / "stale-file").exists()  # replaced, not written over
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pruned"]
    assert cli("generate", out, "--greedy", "--max-new-tokens", "2").returncode == 0


def test_out_that_is_a_file_is_refused_before_pruning(cli, tiny_ckpt, bad_files):
    """Was (#14): the whole model was pruned first, then the save failed."""
    r = cli("prune", tiny_ckpt, "--out", bad_files["words.txt"], *FAST)
    assert_one_line_error(r, 2, "is a file")
    assert "Wanda" not in r.stdout


def test_out_that_is_the_input_or_holds_it(cli, tiny_ckpt, tmp_path):
    src = tmp_path / "src" / "model"
    shutil.copytree(tiny_ckpt, src)
    for out in (src, src.parent):
        r = cli("prune", src, "--out", out, "--overwrite", *FAST)
        assert_one_line_error(r, 2, "would replace the source")
    assert (src / "model.safetensors").is_file()


@pytest.mark.slow
def test_new_directory_is_written_without_a_temporary(cli, tiny_ckpt, tmp_path):
    r = cli("prune", tiny_ckpt, "--out", tmp_path / "new" / "pruned", *FAST)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["pruned"]


def test_nan_weights_are_refused_before_pruning(cli, nan_ckpt, tmp_path):
    """Was (#7): a pruned model written from NaN weights, exit 0."""
    r = cli("prune", nan_ckpt, "--out", tmp_path / "pruned", *FAST)
    assert_one_line_error(r, 2, "holds non-finite weights", "model.norm.weight")
    assert "Wanda" not in r.stdout and not (tmp_path / "pruned").exists()


@pytest.mark.slow
def test_overflowing_activations_stop_pruning(cli, tiny_ckpt, tmp_path):
    """Finite weights whose activations overflow inside a decoder layer: Wanda's scores would be NaN."""
    import torch

    from fusedkv import FusedKVForCausalLM

    src = tmp_path / "overflow"
    model = FusedKVForCausalLM.from_pretrained(tiny_ckpt)
    with torch.no_grad():
        model.model.layers[0].post_attention_layernorm.weight.fill_(3e38)
    model.save_pretrained(src)
    for f in tiny_ckpt.glob("tokenizer*"):
        shutil.copy2(f, src / f.name)
    r = cli("prune", src, "--out", tmp_path / "pruned", *FAST)
    assert_one_line_error(r, 1, "not finite", "nothing was written")
    assert not (tmp_path / "pruned").exists()


def test_convert_of_nan_weights_is_refused(cli, qwen3_src, tmp_path):
    """`fusedkv convert` of a Qwen3 checkpoint with a NaN weight wrote a model that computes NaN."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "qwen3-nan"
    shutil.copytree(qwen3_src, src)
    state = load_file(src / "model.safetensors")
    state["model.norm.weight"][3] = float("inf")
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    r = cli("convert", src, tmp_path / "dst")
    assert_one_line_error(r, 2, "holds non-finite weights", "model.norm.weight (1 of 64 values NaN or inf)")
    assert not (tmp_path / "dst").exists()
