"""The native one-token attention kernel (`fusedkv.kernels.cpu_attention`) against the float64
materialized reference on random inputs: cache dtypes, 1-2 key and value sources, fusion weights per
head or shared, GQA, left padding, strided cache views and odd lengths; what the engine's selection
gives it (and does not); and the model's decode through it against the full forward, with a 16-bit cache
read in place."""

import pytest
import torch

from fusedkv.cache import StaticKVCache
from fusedkv.engine import select_runtime
from fusedkv.engine.selection import LayerFacts
from fusedkv.kernels import cpu_attention, native
from fusedkv.kernels.reference import kv_start_to_mask, materialized_attention
from tests.conftest import tiered, tiny_model

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: the native kernels are not built")


def _sources(n, b, h_kv, length, d, dtype, g, capacity=64):
    """n cache-like strided views: the filled prefix of a [B, H_kv, capacity, D] buffer."""
    return [torch.randn(b, h_kv, capacity, d, generator=g).to(dtype)[:, :, :length] for _ in range(n)]


def _double(ts):
    return [None if t is None else t.double() for t in ts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_k,n_v,weights", [(1, 1, None), (2, 2, "head"), (2, 2, "shared"), (1, 2, "head"),
                                             (2, 1, None)])
@pytest.mark.parametrize("h_q,h_kv", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("length", [1, 7, 50])
def test_matches_the_float64_reference(dtype, n_k, n_v, weights, h_q, h_kv, length):
    g = torch.Generator().manual_seed(length * 100 + h_q * 10 + n_k)
    b, d = 3, 32
    k_src, v_src = _sources(n_k, b, h_kv, length, d, dtype, g), _sources(n_v, b, h_kv, length, d, dtype, g)
    shape = {"head": (h_kv, d), "shared": (d,)}.get(weights)
    k_w = [None if shape is None else torch.randn(*shape, generator=g) for _ in range(n_k)]
    v_w = [None if shape is None else torch.randn(*shape, generator=g) for _ in range(n_v)]
    q = torch.randn(b, h_q, 1, d, generator=g)
    start = torch.tensor([0, length // 2, length - 1])  # left padding: each row's first real key
    out = cpu_attention.one_token_attention(q, k_src, k_w, v_src, v_w, start, d**-0.5)
    ref = materialized_attention(q.double(), _double(k_src), _double(k_w), _double(v_src), _double(v_w),
                                 mask=kv_start_to_mask(start, length), scale=d**-0.5)
    assert out.shape == (b, h_q, 1, d) and out.dtype == torch.float32
    # The cache is read exactly as stored (widened, not rounded again): f32 arithmetic is the only error.
    assert (out.double() - ref).abs().max() < 2e-5 * (1 + ref.abs().max())
    no_padding = cpu_attention.one_token_attention(q, k_src, k_w, v_src, v_w, None, d**-0.5)
    ref_all = materialized_attention(q.double(), _double(k_src), _double(k_w), _double(v_src), _double(v_w),
                                     scale=d**-0.5)
    assert (no_padding.double() - ref_all).abs().max() < 2e-5 * (1 + ref_all.abs().max())


LONG_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# The fast tier: every shape and cache dtype on one thread, and every shape on two threads in f32.
@pytest.mark.parametrize("threads, d, h_q, h_kv, dtype", tiered(
    [(threads, *shape, dtype) for threads in (1, 2) for shape in [(64, 8, 8), (128, 6, 2), (64, 8, 2), (48, 4, 1),
                                                                   (96, 3, 3)] for dtype in LONG_DTYPES],
    lambda threads, d, h_q, h_kv, dtype: threads == 1 or dtype == torch.float32,
    lambda threads, d, h_q, h_kv, dtype: f"{threads}-{d}-{h_q}-{h_kv}-dtype{LONG_DTYPES.index(dtype)}"))
def test_long_caches_match_the_float64_reference(dtype, d, h_q, h_kv, threads):
    """The vector path (4-row blocks, two heads per key row under GQA, prefetch ahead, bf16 deinterleaved) over a
    long cache: head widths on and off its chunk (48: the portable loops under AVX-512), odd and even groups,
    lengths and left padding off the 4-row blocks, a [B, S, H, D] cache (rows H * D apart), 1 and 2 threads."""
    g = torch.Generator().manual_seed(d + h_q)
    b, length = 2, 3001
    k_src = [torch.randn(b, length + 7, h_kv, d, generator=g).to(dtype).transpose(1, 2)[:, :, :length]
             for _ in range(2)]
    v_src = [torch.randn(b, length + 7, h_kv, d, generator=g).to(dtype).transpose(1, 2)[:, :, :length]
             for _ in range(2)]
    k_w = [torch.randn(h_kv, d, generator=g) for _ in range(2)]
    v_w = [torch.randn(h_kv, d, generator=g) for _ in range(2)]
    q = 3 * torch.randn(b, h_q, 1, d, generator=g)  # peaked scores: the softmax's max matters
    start = torch.tensor([5, 1234])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in (1, 2):  # plain reuse (Lite's upper layers), and fusion of two sources with weights
            ws = (k_w[:n], v_w[:n]) if n == 2 else ([None], [None])
            out = cpu_attention.one_token_attention(q, k_src[:n], ws[0], v_src[:n], ws[1], start, d**-0.5)
            ref = materialized_attention(q.double(), _double(k_src[:n]), _double(ws[0]), _double(v_src[:n]),
                                         _double(ws[1]), mask=kv_start_to_mask(start, length), scale=d**-0.5)
            assert (out.double() - ref).abs().max() < 2e-5 * (1 + ref.abs().max()), (n, float((out - ref).abs().max()))
    finally:
        torch.set_num_threads(before)


def test_the_selection_gives_it_only_what_it_takes():
    # The kernel no longer declines per call: what it does not take (blocks, scalar weights, 3+ sources, a
    # model that is not f32 on CPU) never reaches it, because the selection decides once.
    assert not cpu_attention.fits(64, 8, 2, 3, 1) and cpu_attention.fits(64, 8, 2, 2, 2)
    dense = tiny_model("fusedkv-dense")  # upper layers fuse every lower layer with scalars
    chosen = select_runtime(dense).attention
    plan = dense.config.plan
    for layer in dense.model.layers:
        attn = layer.self_attn
        fits = LayerFacts.of(attn, plan).native_fits
        assert fits == attn.layer.stores and (chosen[attn.layer.index] == "NativeOneToken") == fits
    for dtype in (torch.float64, torch.bfloat16):  # one-token steps of other dtypes keep PyTorch's paths
        assert "NativeOneToken" not in select_runtime(tiny_model("fusedkv", dtype=dtype)).attention.values()
    with pytest.raises(ValueError, match="native attention implementation"):
        select_runtime(tiny_model("vanilla", dtype=torch.float64), "native")


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_model_decode_through_the_kernel_matches_the_full_forward(plan_name, kv_dtype):
    """Every plan, left-padded batch, static cache in f32 or bf16: one token at a time (the native path
    where the layer takes it) against the full forward over the same tokens."""
    model = tiny_model(plan_name)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 97, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in row 1
    paths = set(select_runtime(model).attention.values())
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache = StaticKVCache(model.config, 2, 12, kv_dtype)
        out = model(ids[:, :6], attention_mask=mask[:, :6], cache=cache, use_cache=True)
        steps = [out.logits]
        for t in range(6, 12):
            steps.append(model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache, use_cache=True).logits)
    got = torch.cat(steps, dim=1)
    real = mask.bool()
    tol = 1e-4 if kv_dtype == torch.float32 else 3e-2  # a bf16 cache rounds K/V once, when written
    assert (got - full)[real].abs().max() < tol
    assert "NativeOneToken" in paths  # at least the storage layers decode through the kernel


def test_a_16_bit_cache_is_read_in_place_not_upcast():
    """With the native kernel a storage layer hands its readers the cache itself (bf16), not an f32 copy."""
    model = tiny_model("fusedkv-lite")
    select_runtime(model)
    seen = {}

    def record(module, args, output):
        seen[module.layer.index] = args[-1].layers.get(module.layer.index)  # what its readers get

    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(record)
    cache = StaticKVCache(model.config, 1, 8, torch.bfloat16)
    with torch.no_grad():
        out = model(torch.randint(1, 97, (1, 5)), cache=cache, use_cache=True)
        seen.clear()
        model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
    stored = [kv for kv in seen.values() if kv is not None]
    assert stored and all(k.dtype == torch.bfloat16 and v.dtype == torch.bfloat16 for k, v in stored)


def test_forcing_the_native_path_on_a_layer_it_cannot_take_says_so():
    model = tiny_model("fusedkv-dense")  # upper layers fuse every lower layer with scalars
    storage, dense = model.model.layers[0].self_attn, model.model.layers[-1].self_attn
    plan = model.config.plan
    assert LayerFacts.of(storage, plan).native_fits and not LayerFacts.of(dense, plan).native_fits
    assert select_runtime(model).attention[dense.layer.index] != "NativeOneToken"
    with pytest.raises(ValueError, match="native CPU decode kernel"):
        select_runtime(model, "native")
