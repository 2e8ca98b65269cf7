"""Paged Triton decode kernel (and a vLLM batch through it) under the Triton CPU interpreter.

Not collected by the main pytest run: `test_triton_paged_decode.py` runs this file in a subprocess whose
environment has ``TRITON_INTERPRET=1`` from the start (the interpreter must be on before Triton is first
imported). Shapes are tiny: the interpreter executes each program in numpy.
"""

from __future__ import annotations

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/kernels/test_triton_paged_decode.py"

from _paged_decode_checks import check_batch, check_kernel, make_paged, max_error, reference  # noqa: E402

from fusedkv.kernels.triton_paged_decode import paged_decode_attention  # noqa: E402
from tests.conftest import tiered  # noqa: E402

# Block 16: 1 token, a full block, lengths inside a block, three blocks and a bit.
SEQ_LENS = [1, 16, 37, 50]


@pytest.mark.parametrize("sources", ["fusedkv", "lite", "mixed", "plain"])
@pytest.mark.parametrize("g", [1, 2])
def test_kernel_matches_reference(sources, g):
    n_k, n_v, weighted = {"fusedkv": (2, 2, True), "lite": (1, 1, False), "mixed": (2, 1, True),
                          "plain": (1, 2, False)}[sources]
    check_kernel(SEQ_LENS, 2, g, n_k, n_v, weighted, "cpu", num_splits=3, block_n=16)


def test_single_split_contiguous_caches_head_dim_32():
    check_kernel([5, 33], 2, 2, 2, 2, True, "cpu", num_splits=1, vllm_strides=False, d=32)


def test_dot_path_many_query_heads_and_automatic_launch():
    check_kernel([23, 40], 1, 8, 2, 2, True, "cpu")  # G = 8 uses tl.dot; split count and tile chosen


def test_zero_length_row_gives_zeros_and_max_seq_len_bound():
    dev, _ = make_paged([0, 20], 2, 2, 2, 2, True, spare_blocks=1)
    dev["seq_lens"][0] = 0
    out = paged_decode_attention(dev["q"], dev["key_caches"], dev["k_weights"], dev["value_caches"],
                                 dev["v_weights"], dev["block_table"], dev["seq_lens"], max_seq_len=20,
                                 num_splits=2, block_n=16)
    assert torch.isfinite(out).all() and out[0].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision(dtype):
    check_kernel([9, 37], 2, 2, 2, 2, True, "cpu", dtype=dtype, num_splits=2, block_n=16, tol=2e-2)


@pytest.mark.parametrize("use_kernel", [True, False])
def test_mixed_batch_decode_rows_and_prefill_chunks(use_kernel):
    # Requests: decode (1 of 37), a prefill chunk (5 new of 37), decode of a length-1 sequence, a whole
    # prompt (20 of 20), decode (1 of 16).
    check_batch([37, 37, 1, 20, 16], [1, 5, 1, 20, 1], 2, 2, 2, 2, True, "cpu", use_kernel=use_kernel)


def test_decode_only_batch_is_one_launch():
    check_batch([1, 16, 37], [1, 1, 1], 2, 2, 1, 1, False, "cpu", use_kernel=True)  # Lite, max_query_len 1


def test_argument_errors():
    dev, _ = make_paged([5], 2, 1, 1, 1, False, spare_blocks=1)
    q, kc, vc, table, lens = dev["q"], dev["key_caches"], dev["value_caches"], dev["block_table"], dev["seq_lens"]
    bad = {
        "1 or 2 K": dict(key_caches=kc * 3),
        "head_dim": dict(q=q[..., :12], key_caches=[c[..., :12] for c in kc], value_caches=[c[..., :12] for c in vc]),
        "multiple of H_kv": dict(q=q[:, :1]),
        "block_table": dict(block_table=table.float()),
        "seq_lens": dict(seq_lens=lens[None]),
        "one dtype": dict(value_caches=[c.half() for c in vc]),
        "q must be": dict(q=q[:, :, None]),
    }
    for message, change in bad.items():
        args = dict(q=q, key_caches=kc, k_weights=None, value_caches=vc, v_weights=None, block_table=table,
                    seq_lens=lens) | change
        with pytest.raises(ValueError, match=message):
            paged_decode_attention(**args)


# ---- sliding window and soft cap (Gemma 2 / Mistral-style layers served on GPU) ----------------------------
# Block 16; lengths shorter than, equal to and longer than the window, ending mid-block and on a block's end.
WINDOW_LENS = [1, 7, 19, 20, 21, 32, 50]
# (K sources, V sources, weighted, G, window, softcap): FusedKV (2 K, 2 V, weights), Lite (1 K, 1 V), GQA and
# MHA, tl.dot (G = 8); window 1 (only the query's own key), a window inside one block, one over three.
WINDOW_CASES = tiered(
    [(2, 2, True, 2, 20, None), (1, 1, False, 1, 20, 2.5), (2, 2, True, 2, 20, 2.5), (2, 1, True, 1, 1, None),
     (2, 2, True, 8, 7, 2.5), (1, 2, False, 2, 16, None), (2, 2, True, 2, None, 2.5), (2, 2, True, 1, 48, 2.5)],
    lambda n_k, n_v, weighted, g, window, softcap: (n_k, g, window) in [(2, 2, 20), (1, 1, 20)],
    lambda *case: "k{}-v{}-{}-g{}-w{}-cap{}".format(*case))


@pytest.mark.parametrize("n_k, n_v, weighted, g, window, softcap", WINDOW_CASES)
def test_window_and_softcap_kernel(n_k, n_v, weighted, g, window, softcap):
    # Scale 1 (head_dim 16): scores of a few units, so a cap of 2.5 changes the attention a lot.
    out, ref = check_kernel(WINDOW_LENS, 2, g, n_k, n_v, weighted, "cpu", scale=1.0, window=window, softcap=softcap,
                            num_splits=3, block_n=16)
    # The test can fail: without the window (or the cap) the reference is far from what the kernel gave.
    for wrong in ([reference(ref, 1.0, None, softcap)] if window and window < max(WINDOW_LENS) else []) + (
            [reference(ref, 1.0, window, None)] if softcap else []):
        assert max_error(out, wrong) > 1e-2


def test_window_automatic_launch_and_long_sequence():
    # Splits cut the window only (chosen automatically): most of a 300-key sequence lies left of it (NaN there).
    check_kernel([300, 5, 129], 2, 2, 2, 2, True, "cpu", window=24, softcap=2.5, scale=1.0)


@pytest.mark.parametrize("use_kernel, window, softcap", tiered(
    [(True, 8, 2.5), (False, 8, 2.5), (True, 1, None), (False, 1, None), (True, 20, None), (False, None, 2.5)],
    lambda use_kernel, window, softcap: window == 8))
def test_window_and_softcap_mixed_batch(use_kernel, window, softcap):
    # Decode rows shorter and longer than the window, a chunk of 20 starting mid-sequence (keys 0..29 of 50, a
    # window of 8 skips the first block), a whole prompt longer than the window, a chunk of 5 at 37.
    check_batch([50, 37, 3, 20, 16, 37], [20, 1, 1, 20, 1, 5], 2, 2, 2, 2, True, "cpu", use_kernel=use_kernel,
                scale=1.0, window=window, softcap=softcap)


def test_window_and_softcap_argument_errors():
    dev, _ = make_paged([5], 2, 1, 1, 1, False, spare_blocks=1)
    args = (dev["q"], dev["key_caches"], None, dev["value_caches"], None, dev["block_table"], dev["seq_lens"])
    for bad, message in ((dict(window=0), "window"), (dict(window=2.5), "window"), (dict(softcap=-1.0), "softcap")):
        with pytest.raises(ValueError, match=message):
            paged_decode_attention(*args, **bad)
