"""`fusedkv generate` under bad flags and broken checkpoints, through the real CLI: every numeric flag
range-checked before the model loads, a request beyond the model context refused before any token is
generated, and NaN logits an error (exit 1) instead of confident tokens."""

from __future__ import annotations

import pytest

from tests.reliability.conftest import CONTEXT, assert_one_line_error


def test_generate_runs(cli, tiny_ckpt):
    r = cli("generate", tiny_ckpt, "--max-new-tokens", "5", "--greedy")
    assert r.returncode == 0, r.stderr
    assert "5 new tokens" in r.stderr


@pytest.mark.parametrize("args, fragment", [
    (("--max-new-tokens", "0"), "argument --max-new-tokens: must be at least 1"),
    (("--max-new-tokens", "-5"), "argument --max-new-tokens: must be at least 1"),
    (("--max-new-tokens", "99999999999"), "argument --max-new-tokens: must be at most"),
    (("--temperature", "-1"), "argument --temperature: must be in [0, inf]"),
    (("--temperature", "nan"), "argument --temperature: expected a finite number"),
    (("--top-k", "-1"), "argument --top-k: must be at least 0"),
    (("--top-p", "0"), "argument --top-p: must be in (0, 1]"),  # was accepted
    (("--top-p", "2"), "argument --top-p: must be in (0, 1]"),  # was accepted
    (("--num-samples", "0"), "argument --num-samples: must be between 1 and 4096"),  # was an IndexError
    (("--seed", "-1"), "argument --seed: must be between 0"),
    (("--seed", "1.5"), "argument --seed: expected an integer"),
])
def test_flags_are_range_checked(cli, tiny_ckpt, args, fragment):
    assert_one_line_error(cli("generate", tiny_ckpt, *args), 2, "fusedkv generate: error:", fragment)


def test_request_beyond_the_context_is_refused_before_generating(cli, tiny_ckpt):
    """A 64-token model failed after generating 63 tokens of the default 100."""
    r = cli("generate", tiny_ckpt, "--max-new-tokens", str(CONTEXT + 10), "--greedy")
    assert_one_line_error(r, 2, f"--max-new-tokens {CONTEXT + 10} does not fit", f"context is {CONTEXT}")
    assert r.stdout == ""


def test_the_default_length_fits_a_short_context(cli, tiny_ckpt):
    """The default (100 new tokens) is cut to what the 64-token context leaves after the prompt."""
    r = cli("generate", tiny_ckpt, "--greedy")
    assert r.returncode == 0, r.stderr
    new = int(r.stderr.split("plan ")[1].split(": ")[1].split(" new tokens")[0])
    assert 0 < new < CONTEXT


@pytest.mark.slow
def test_empty_prompt_and_bad_checkpoints(cli, tiny_ckpt, bad_files, qwen3_src):
    assert_one_line_error(cli("generate", tiny_ckpt, "--prompt", ""), 2, "empty")
    assert_one_line_error(cli("generate", bad_files["a-directory"]), 2, "no config.json")
    assert_one_line_error(cli("generate", bad_files["random.bin"]), 2, "random.bin")
    assert_one_line_error(cli("generate", bad_files["missing"]), 2, "no-such-file.txt")
    assert_one_line_error(cli("generate", qwen3_src), 2, "fusedkv convert")
    assert_one_line_error(cli("generate", ""), 2, "argument checkpoint: must not be empty")


@pytest.mark.parametrize("sampling", [("--greedy",), ("--temperature", "0.8")])
def test_nan_logits_are_an_error(cli, overflow_ckpt, sampling):
    """Was: --greedy printed tokens from NaN logits with exit 0 (sampling died in torch.multinomial).
    Finite weights whose logits overflow: a failure while running (exit 1)."""
    r = cli("generate", overflow_ckpt, "--max-new-tokens", "3", *sampling)
    assert_one_line_error(r, 1, "logits are not finite")
    assert r.stdout == ""


def test_nan_weights_are_refused_at_load(cli, nan_ckpt):
    """A NaN weight (corrupt bytes) is refused when the checkpoint loads, naming the tensor (exit 2)."""
    r = cli("generate", nan_ckpt, "--max-new-tokens", "3", "--greedy")
    assert_one_line_error(r, 2, "holds non-finite weights", "model.norm.weight (1 of 64 values NaN or inf)")
    assert r.stdout == ""
