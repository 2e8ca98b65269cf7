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

from _paged_decode_checks import check_batch, check_kernel, make_paged  # noqa: E402

from fusedkv.kernels.triton_paged_decode import paged_decode_attention  # noqa: E402

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
