"""`fusedkv train`'s model inputs, checked before any work: a missing --init-from directory is named
without a trip to the Hugging Face hub, and a model with non-finite weights is refused."""

import pytest

from tests.reliability.conftest import assert_one_line_error

NANO = ("--preset", "nano", "--max-steps", "1", "--quiet")
# The hub "reachable" but refusing at once: before the fix this produced transformers' hub error.
HUB_ONLINE = {"HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}


@pytest.mark.slow
def test_missing_init_from_is_a_local_path_error(cli, tmp_path):
    """Was (#13): a bare directory name was taken for a hub id and the hub's network error printed."""
    for missing in ("no-such-run-final", "runs/no-such/final"):
        r = cli("train", "--init-from", missing, "--out", tmp_path / "run", *NANO, env=HUB_ONLINE, cwd=tmp_path,
                timeout=120)
        line = assert_one_line_error(r, 2, f"--init-from {missing} does not exist", "saved model directory")
        assert "huggingface" not in r.stderr.lower() and "hub" not in line
    assert not (tmp_path / "run").exists()


def test_init_from_a_file_is_refused(cli, bad_files, tmp_path):
    r = cli("train", "--init-from", bad_files["words.txt"], "--out", tmp_path / "run", *NANO)
    assert_one_line_error(r, 2, "is a file")


def test_init_from_nan_weights_is_refused_before_training(cli, tiny_ckpt, tmp_path):
    """#7 for train: the NaN model was loaded, its data prepared, and training stopped on a NaN loss."""
    import shutil

    import torch
    from transformers import AutoTokenizer

    from tests.conftest import tiny_model

    src = tmp_path / "nan-model"
    vocab = len(AutoTokenizer.from_pretrained(tiny_ckpt))  # a model the tokenizer fits: only the NaN is wrong
    model = tiny_model("fusedkv", vocab_size=vocab, max_position_embeddings=64)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    model.save_pretrained(src)
    for f in tiny_ckpt.glob("tokenizer*"):
        shutil.copy2(f, src / f.name)
    r = cli("train", "--init-from", src, "--out", tmp_path / "run", *NANO, "--set", "seq_len=32", timeout=300)
    assert_one_line_error(r, 2, "holds non-finite weights", "model.norm.weight")
    assert not (tmp_path / "run" / "final").exists()
