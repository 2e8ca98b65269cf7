"""The native CPU product (`fusedkv.kernels.cpu_gemv`) against a float64 reference, and its build:
odd sizes, slices of a packed buffer, bias, 1-4 rows, one and two threads; what it declines; the
cached library, a broken compiler and the switch that turns it off."""

import pytest
import torch

from fusedkv.kernels import cpu_gemv, native
from tests.conftest import tiered

needs_native = pytest.mark.skipif(not native.available(), reason="no C compiler: the native kernel is not built")


def column_major(w: torch.Tensor) -> torch.Tensor:
    return w.t().contiguous().t()


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("in_features,out_features", [(64, 96), (37, 50), (200, 8), (512, 1536), (5, 3)])
def test_matches_float64_reference(rows, in_features, out_features, threads):
    g = torch.Generator().manual_seed(rows * 1000 + in_features)
    w = column_major(torch.randn(out_features, in_features, generator=g))
    bias = torch.randn(out_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = cpu_gemv.linear(x, w, bias)
        y_nobias = cpu_gemv.linear(x.view(rows, 1, in_features), w)
    finally:
        torch.set_num_threads(before)
    ref = x.double() @ w.double().T
    tol = 1e-5 * in_features**0.5
    assert y.shape == (rows, out_features) and y.dtype == torch.float32
    assert (y.double() - (ref + bias.double())).abs().max() < tol
    assert y_nobias.shape == (rows, 1, out_features)  # leading dims kept, as F.linear
    assert (y_nobias.view(rows, -1).double() - ref).abs().max() < tol


@needs_native
def test_reads_a_column_slice_of_a_packed_buffer_in_place():
    """Q|K|V in one column-major buffer: each module's weight is a row slice with the buffer's stride."""
    sizes = [48, 16, 16]
    buffer = torch.randn(64, sum(sizes)).t()  # [out, in], column-major
    x = torch.randn(2, 64)
    offset = 0
    for n in sizes:
        w = buffer[offset:offset + n]
        assert w.stride() == (1, sum(sizes))
        assert (cpu_gemv.linear(x, w).double() - x.double() @ w.double().T).abs().max() < 1e-4
        offset += n


@needs_native
def test_declines_what_it_does_not_run():
    w = torch.randn(32, 16)
    x = torch.randn(1, 16)
    assert cpu_gemv.linear(x, w) is None  # row-major weight: PyTorch's layout, not the decode layout
    cm = column_major(w)
    assert cpu_gemv.linear(torch.randn(cpu_gemv.MAX_ROWS + 1, 16), cm) is None  # a prefill block
    assert cpu_gemv.linear(x.bfloat16(), cm.bfloat16()) is None  # f32 only
    grad_w = column_major(torch.randn(32, 16)).requires_grad_()
    assert cpu_gemv.linear(x, grad_w) is None  # autograd must see the product
    with torch.no_grad():
        assert cpu_gemv.linear(x, grad_w) is not None  # inference on trainable weights is fine


@needs_native
@pytest.mark.slow  # compiles the kernels into a fresh cache: the full suite's
def test_build_is_cached_and_reused(tmp_path, monkeypatch):
    """A fresh cache directory gets one library, written whole (no temporary left behind); deciding again
    finds it and does not rebuild."""
    monkeypatch.setenv("FUSEDKV_CACHE", str(tmp_path))
    w, x = column_major(torch.randn(8, 4)), torch.ones(1, 4)
    try:
        native.redecide()
        assert cpu_gemv.linear(x, w) is not None
        built = list((tmp_path / "native").iterdir())
        assert len(built) == 1 and built[0].name.startswith("fusedkv-cpu-") and built[0].suffix == ".so"
        stamp = built[0].stat().st_mtime_ns
        native.redecide()
        assert cpu_gemv.linear(x, w) is not None
        assert list((tmp_path / "native").iterdir()) == built and built[0].stat().st_mtime_ns == stamp
    finally:
        monkeypatch.undo()
        native.redecide()


def test_a_failing_compiler_falls_back_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEDKV_CACHE", str(tmp_path))  # nothing cached there: a build is needed
    monkeypatch.setenv("CC", "/bin/false")
    try:
        native.redecide()
        with pytest.warns(UserWarning, match="native CPU decode kernels are unavailable"):
            assert not native.available()
        assert cpu_gemv.linear(torch.ones(1, 4), column_major(torch.randn(8, 4))) is None
    finally:
        monkeypatch.undo()
        native.redecide()


def test_the_switch_turns_it_off_and_decoding_still_works(torch_kernels):
    from fusedkv.generation import generate
    from tests.conftest import tiny_model

    assert not native.available()
    w = column_major(torch.randn(8, 4))
    assert cpu_gemv.linear(torch.ones(1, 4), w) is None
    model = tiny_model("fusedkv-lite")
    ids = torch.randint(1, 97, (1, 6))
    out = generate(model, ids, 4, weight_layout="packed")
    assert out.tokens.shape == (1, 10)


def _decode_logits(model, ids):
    with torch.no_grad():
        out = model(ids[:, :1], use_cache=True)
        steps, cache = [out.logits], out.cache
        for t in range(1, ids.shape[1]):
            steps.append(model(ids[:, t:t + 1], cache=cache, use_cache=True).logits)
    return torch.cat(steps, dim=1)


@needs_native
def test_native_decode_matches_torch_decode_and_the_full_forward(plan_name, monkeypatch):
    """The same packed model decoded one token at a time with the native kernel and with PyTorch's, and
    scored in one full forward: the same logits up to f32 rounding."""
    from fusedkv.engine.selection import set_decode_layout
    from tests.conftest import tiny_model

    model = set_decode_layout(tiny_model(plan_name), "packed")
    ids = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    with_native = _decode_logits(model, ids)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    monkeypatch.setenv("FUSEDKV_NATIVE_KERNELS", "0")
    native.redecide()
    try:
        torch_decode = _decode_logits(model, ids)
    finally:
        monkeypatch.undo()
        native.redecide()
    assert (with_native - torch_decode).abs().max() < 1e-5
    assert (with_native - full).abs().max() < 1e-4


needs_blocks = pytest.mark.skipif(not cpu_gemv.blocks_available(),
                                reason="no block kernels here (neither AVX-512 BF16 nor AVX2)")


@needs_blocks
@pytest.mark.parametrize("rows", [1, 2, 4, 7, 16])
@pytest.mark.parametrize("out_features,in_features", [(16, 3), (48, 37), (96, 64), (1536, 512)])
def test_bf16_blocks_match_the_float64_product_of_the_rounded_operands(rows, out_features, in_features):
    """The block kernel computes x_bf16 . W_bf16 in f32: against float64 over the same rounded values."""
    g = torch.Generator().manual_seed(out_features + in_features)
    w, x, bias = (torch.randn(out_features, in_features, generator=g), torch.randn(rows, in_features, generator=g),
                  torch.randn(out_features, generator=g))
    blocks = cpu_gemv.to_bf16_blocks(w)
    assert torch.equal(cpu_gemv.from_blocks(blocks, in_features), w.bfloat16())  # the layout round-trips
    ref = x.bfloat16().double() @ w.bfloat16().double().T
    tol = 1e-5 * in_features**0.5
    assert (cpu_gemv.linear_blocks(x, blocks, in_features, bias=bias).double() - ref - bias.double()).abs().max() < tol
    if blocks.shape[0] > 2:  # an output slice of whole blocks (one projection of a packed group) reads in place
        part = cpu_gemv.linear_blocks(x, blocks[1:3], in_features)
        assert (part.double() - ref[:, 16:48]).abs().max() < tol


needs_f16_blocks = pytest.mark.skipif(not cpu_gemv.f16_blocks_available(), reason="no AVX2 + F16C here")


@needs_f16_blocks
@pytest.mark.parametrize("rows", [1, 2, 3, 16])
@pytest.mark.parametrize("out_features,in_features", [(16, 3), (48, 37), (96, 64), (1536, 512)])
def test_f16_blocks_match_the_float64_product(rows, out_features, in_features):
    """f16 blocks compute x . W_f16 in f32 with x as given (not rounded): against float64 over the same f16
    weights, with a bias, an odd last channel (paired with a zero), and an output slice of blocks."""
    g = torch.Generator().manual_seed(3 * out_features + in_features)
    w, x, bias = (torch.randn(out_features, in_features, generator=g), torch.randn(rows, in_features, generator=g),
                  torch.randn(out_features, generator=g))
    blocks = cpu_gemv.to_blocks(w.half())
    assert blocks.dtype == torch.float16 and torch.equal(cpu_gemv.from_blocks(blocks, in_features), w.half())
    ref = x.double() @ w.half().double().T
    tol = 1e-5 * in_features**0.5
    assert (cpu_gemv.linear_blocks(x, blocks, in_features, bias=bias).double() - ref - bias.double()).abs().max() < tol
    if blocks.shape[0] > 2:
        part = cpu_gemv.linear_blocks(x, blocks[1:3], in_features)
        assert (part.double() - ref[:, 16:48]).abs().max() < tol


@needs_f16_blocks
def test_f16_reduced_linear_uses_the_blocks():
    """`ReducedLinear` f16 stores blocks where the kernel runs: few rows through it (x not rounded), many rows
    through the GEMM over the dequantised weight, a slice in place."""
    from torch import nn

    from fusedkv.engine.precision import ReducedLinear

    linear = nn.Linear(40, 48, bias=True)
    reduced = ReducedLinear.from_linears([linear], "float16")
    assert reduced.blocked and reduced.weight.dtype == torch.float16
    x = torch.randn(3, 40)
    with torch.no_grad():
        ref = x.double() @ linear.weight.half().double().T + linear.bias.double()
        assert (reduced(x).double() - ref).abs().max() < 1e-5
        assert (reduced(x.repeat(6, 1))[:3].double() - ref).abs().max() < 1e-2  # 18 rows: the GEMM path
        assert (reduced.slice(16, 32)(x).double() - ref[:, 16:32]).abs().max() < 1e-5


@needs_blocks
def test_bf16_blocks_decline_and_reduced_linear_uses_them():
    from torch import nn

    from fusedkv.engine.precision import ReducedLinear

    assert cpu_gemv.to_bf16_blocks(torch.randn(20, 8)) is None  # outputs not whole blocks
    linear = nn.Linear(40, 32, bias=True)
    reduced = ReducedLinear.from_linears([linear], "bfloat16")
    assert reduced.blocked and reduced.weight.dim() == 4
    x = torch.randn(3, 40)
    with torch.no_grad():
        ref = torch.nn.functional.linear(x.bfloat16().double(), linear.weight.bfloat16().double()) + linear.bias
        few, many = reduced(x), reduced(torch.randn(20, 40))  # the kernel; the GEMM over re-laid-out blocks
        assert (few.double() - ref).abs().max() < 1e-4 and many.shape == (20, 32)
        many_ref = reduced(x.repeat(6, 1))[:3]  # 18 rows: the GEMM path on the same inputs
        assert (many_ref.double() - ref).abs().max() < 1e-2


@needs_blocks
@pytest.mark.parametrize("rows", [1, 2, 4, 7, 16])
@pytest.mark.parametrize("out_features,in_features", [(16, 3), (48, 37), (96, 64), (1536, 512)])
def test_int8_blocks_match_the_float64_product(rows, out_features, in_features):
    """int8 blocks compute scale (.) (x_bf16 . q) in f32: against float64 over the same rounded input and
    the same integers, whole and as an output slice of blocks with its slice of scales."""
    from fusedkv.engine.precision import quantize_int8

    g = torch.Generator().manual_seed(out_features * in_features)
    w, x, bias = (torch.randn(out_features, in_features, generator=g), torch.randn(rows, in_features, generator=g),
                  torch.randn(out_features, generator=g))
    q, scale = quantize_int8(w)
    blocks = cpu_gemv.to_blocks(q)
    assert blocks.dtype == torch.int8 and torch.equal(cpu_gemv.from_blocks(blocks, in_features), q)
    ref = (x.bfloat16().double() @ q.double().T) * scale.double()
    tol = 1e-5 * in_features**0.5 * scale.max().item() * 127
    got = cpu_gemv.linear_blocks(x, blocks, in_features, scale, bias)
    assert (got.double() - ref - bias.double()).abs().max() < tol
    if blocks.shape[0] > 2:
        part = cpu_gemv.linear_blocks(x, blocks[1:3], in_features, scale[16:48])
        assert (part.double() - ref[:, 16:48]).abs().max() < tol
    assert cpu_gemv.linear_blocks(x, blocks, in_features) is None  # int8 without its scales: declined


@needs_blocks
def test_int8_reduced_linear_uses_the_blocks():
    """`ReducedLinear` int8 stores blocks where the kernel runs; its few-row product (the kernel), many-row
    product (the bf16 GEMM over the dequantised weight) and a slice agree with the quantised reference."""
    from torch import nn

    from fusedkv.engine.precision import ReducedLinear, quantize_int8

    linear = nn.Linear(40, 48, bias=True)
    reduced = ReducedLinear.from_linears([linear], "int8")
    assert reduced.blocked and reduced.weight.dtype == torch.int8 and reduced.scale.dtype == torch.float32
    q, scale = quantize_int8(linear.weight)
    x = torch.randn(3, 40)
    with torch.no_grad():
        ref = (x.bfloat16().double() @ q.double().T) * scale.double() + linear.bias.double()
        assert (reduced(x).double() - ref).abs().max() < 1e-4
        assert (reduced(x.repeat(6, 1))[:3].double() - ref).abs().max() < 2e-2  # 18 rows: the GEMM path
        part = reduced.slice(16, 32)
        assert (part(x).double() - ref[:, 16:32]).abs().max() < 1e-4
        torch.testing.assert_close(reduced.dequantized(torch.float32), q.float() * scale[:, None])


def _int4(out_features: int, in_features: int, seed: int):
    from fusedkv.engine.precision import quantize_int4

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * torch.logspace(-2, 0, in_features)  # scales differ
    q, scale = quantize_int4(w)
    w_deq = (q.double() * scale.double().repeat_interleave(cpu_gemv.GROUP, 1)[:, :in_features])  # exact in f64
    return q, scale, w_deq


# The fast tier: every shape and row count on one thread, and 1 and 16 rows on two threads.
@needs_native
@pytest.mark.parametrize("out_features, in_features, rows, threads", tiered(
    [(*shape, rows, threads) for shape in [(16, 3), (48, 31), (32, 32), (40, 33), (16, 63), (64, 65), (96, 95),
                                           (256, 512)] for rows in (1, 2, 3, 4, 5, 7, 8, 16) for threads in (1, 2)],
    lambda out_features, in_features, rows, threads: threads == 1 or rows in (1, 16)))
def test_int4_blocks_match_the_float64_product(rows, out_features, in_features, threads):
    """int4 blocks compute sum_g scale_g (x_bf16 . q_g) in f32: against float64 over the same integers, scales
    and rounded input, every group boundary (31-33, 63-65 inputs), outputs not whole blocks (padded), 1-16
    rows, with a bias, and an output slice of blocks with its scales."""
    q, scale, w = _int4(out_features, in_features, out_features * in_features + rows)
    packed, scales = cpu_gemv.to_int4_blocks(q, scale)
    q2, s2 = cpu_gemv.from_int4_blocks(packed, scales)  # the layout round-trips, padding zero
    assert torch.equal(q2[:out_features, :in_features], q) and torch.equal(s2[:out_features], scale)
    assert not q2[out_features:].any() and not q2[:, in_features:].any()
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    xd = x.bfloat16().double()
    ref = xd @ w.T
    tol = 1e-6 * (xd.abs() @ w.abs().T).max().item() + 1e-30  # f32 accumulation of exact products
    bias = torch.randn(packed.shape[0] * cpu_gemv.BLOCK)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_gemv.linear_int4(x, packed, scales, in_features, bias)
        assert (got[:, :out_features].double() - ref - bias[:out_features].double()).abs().max() <= tol
        assert torch.equal(got[:, out_features:], bias[out_features:].expand(rows, -1))  # padded outputs: 0 + bias
        if out_features >= 48:
            part = cpu_gemv.linear_int4(x, packed[1:3], scales[1:3], in_features)
            assert (part.double() - ref[:, 16:48]).abs().max() <= tol
    finally:
        torch.set_num_threads(before)


@needs_native
@pytest.mark.parametrize("in_features", [33, 96])
def test_int4_every_channel_lands_in_its_group(in_features):
    """x = e_i picks column i of W exactly (1 * level * f16 scale is exact in f32): every channel of every
    group, and every nibble position of the packing, is where the layout says."""
    q, scale, w = _int4(48, in_features, 7)
    packed, scales = cpu_gemv.to_int4_blocks(q, scale)
    eye = torch.eye(in_features)
    cols = torch.cat([cpu_gemv.linear_int4(eye[i:i + 16], packed, scales, in_features)
                      for i in range(0, in_features, 16)])
    assert torch.equal(cols.double(), w.T)


@needs_native
def test_int4_declines_what_it_does_not_cover():
    q, scale, _ = _int4(32, 40, 1)
    packed, scales = cpu_gemv.to_int4_blocks(q, scale)
    assert cpu_gemv.linear_int4(torch.randn(17, 40), packed, scales, 40) is None  # more rows than the kernel takes
    assert cpu_gemv.linear_int4(torch.randn(2, 40).double(), packed, scales, 40) is None  # not f32
    assert cpu_gemv.linear_int4(torch.randn(2, 40), packed, scales.transpose(0, 1), 40) is None  # scales re-laid
