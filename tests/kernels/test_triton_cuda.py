"""The Triton decode kernel on a GPU against the fp32 reference, over the shapes the benchmark times and
their awkward neighbours: S not a multiple of the block, left padding, G = 1 .. 64, 1-2 sources, with and
without weights, fp32 (rel. err < 1e-4) and bf16 / fp16 (< 2e-2). Skipped without CUDA; the same kernel
runs on CPU under the Triton interpreter in `test_triton_kernel.py`."""

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                                reason="needs CUDA and Triton")

# (B, H_kv, G, S, D, sources, num_splits); sources: fusedkv | lite | mha | mixed
SHAPES = [(2, 4, 1, 1000, 128, "fusedkv", None), (3, 2, 4, 777, 64, "fusedkv", 3),
          (2, 2, 8, 513, 32, "mha", 1), (1, 2, 64, 4097, 128, "fusedkv", None),
          (2, 1, 16, 300, 16, "mixed", 5), (2, 8, 1, 2049, 128, "lite", None),
          (4, 16, 1, 8191, 128, "fusedkv", None), (1, 2, 6, 100, 64, "mha", 2)]


def _rel_err(out, ref):
    ref = ref.double()
    return ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2), (torch.float16, 2e-2)])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_kernel_matches_reference(shape, dtype, tol):
    from fusedkv.kernels import fused_decode_attention, kv_start_to_mask, materialized_attention

    b, h_kv, g, s, d, kind, splits = shape
    gen = torch.Generator().manual_seed(0)

    def rnd(*size):
        return torch.randn(*size, generator=gen).cuda()

    q = rnd(b, h_kv * g, d)
    k1, kn, v1, vn = (rnd(b, h_kv, s, d) for _ in range(4))
    a1, an, b1, bn = (rnd(h_kv, d) for _ in range(4))
    args = {"fusedkv": (q, [k1, kn], [a1, an], [v1, vn], [b1, bn]), "lite": (q, [kn], None, [v1], None),
            "mha": (q, [k1], None, [v1], None), "mixed": (q, [k1, kn], [a1, None], [vn], [bn])}[kind]
    low = [args[0].to(dtype), [x.to(dtype) for x in args[1]], args[2], [x.to(dtype) for x in args[3]], args[4]]
    kv_start = torch.zeros(b, dtype=torch.long, device="cuda")
    kv_start[-1] = min(s - 1, 300)  # left padding on the last row
    out = fused_decode_attention(*low, kv_start=kv_start, num_splits=splits)
    ref = materialized_attention(args[0][:, :, None], *args[1:], mask=kv_start_to_mask(kv_start, s))[:, :, 0]
    assert out.dtype == dtype
    assert _rel_err(out, ref) < tol
