"""Run by test_gpu_backend_path.py with the vLLM environment's Python and TRITON_INTERPRET=1: a FusedKV
reconstruction layer built on vLLM's FlashAttention and Triton backend impls takes the GPU path (the
paged Triton kernel for decode rows, gathered prefill), reads the source layers' caches in those
backends' [num_blocks, H_kv, block_size, 2 * D] layout through vLLM's own metadata and forward-context
classes, and equals a float64 reference with the fused K/V materialised; also with a sliding window and
Gemma 2's soft cap as vLLM hands them to those impls (the window as FlashAttention's (W - 1, 0)). The
caches are CPU tensors (the interpreter runs the kernel); the layers themselves hold only their cache, as
vLLM's do at run time."""

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from vllm.forward_context import ForwardContext, override_forward_context
from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl, FlashAttentionMetadata
from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl, TritonAttentionMetadata

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from _paged_decode_checks import make_paged, max_error, poison_left_of_window, reference  # noqa: E402

from fusedkv.model.fusion import KVSources  # noqa: E402
from fusedkv.serving.paged import CrossLayerAttention, select_paths  # noqa: E402

H_KV, G, D = 2, 2, 16
SEQ_LENS, QUERY_LENS = [37, 37, 1, 20, 16], [1, 5, 1, 20, 1]


def run(impl_cls, meta_cls, extra, query_lens, window=None, softcap=None, other_group=None):
    seq_lens = SEQ_LENS[:len(query_lens)]
    dev, ref = make_paged(seq_lens, H_KV, G, 2, 2, True, query_lens=query_lens, seed=2)
    if window:
        poison_left_of_window(dev, ref, window)  # a window layer's freed blocks: never read
    scale = 1.0 if softcap else D**-0.5  # larger scores, so the cap matters
    impl = impl_cls(num_heads=H_KV * G, head_size=D, scale=scale, num_kv_heads=H_KV, alibi_slopes=None,
                    sliding_window=window, kv_cache_dtype="auto", logits_soft_cap=softcap)
    # FusedKV: K from layers 1 and 2, V from layers 0 and 1 (make_paged's convention), weighted.
    layer = CrossLayerAttention(impl, ["l1", "l2"], ["l0", "l1"])
    layer.take(KVSources((), tuple(dev["k_weights"]), (), tuple(dev["v_weights"])))  # as serving's loading does
    select_paths([layer], torch.float32, torch.device("cpu"), block_size=16)  # as serving's weight loading does
    assert layer.on_gpu and layer.path == "triton", impl_cls
    t = dev["q"].shape[0]
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = meta_cls(num_actual_tokens=t, max_query_len=max(query_lens), query_start_loc=starts,
                    max_seq_len=max(seq_lens), seq_lens=dev["seq_lens"], block_table=dev["block_table"],
                    slot_mapping=torch.zeros(t, dtype=torch.long), **extra)
    query = torch.cat([dev["q"], torch.randn(3, *dev["q"].shape[1:])])  # 3 padding rows past num_actual_tokens
    output = torch.full_like(query, float("nan"))
    layers = {f"l{i}": SimpleNamespace(kv_cache=kv) for i, kv in enumerate(dev["layers"])}
    # Per layer, its KV-cache group's metadata, as the runner gives it: one group (one block table) for all, or
    # `other_group` in a group of its own (vLLM's hybrid KV-cache manager), which the layer must refuse.
    per_layer = {name: meta for name in layers}
    if other_group:
        per_layer[other_group] = meta_cls(**{**vars(meta), "block_table": meta.block_table.clone()})
    with override_forward_context(ForwardContext(no_compile_layers=layers, attn_metadata=per_layer, slot_mapping={})):
        if other_group:
            try:
                layer.forward(None, query, None, None, None, meta, output)
            except NotImplementedError as e:
                assert "--disable-hybrid-kv-cache-manager" in str(e) and other_group in str(e), e
                return
            raise AssertionError("a source in another KV-cache group was not refused")
        layer.forward(None, query, None, None, None, meta, output)
    err = max_error(output[:t], reference(ref, scale, window, softcap))
    assert err < 1e-5, (impl_cls.__name__, query_lens, window, softcap, err)
    if window:  # the window is the model's p - W < k <= p: one key more or less is far off
        for wrong in (window - 1, window + 1):
            assert max_error(output[:t], reference(ref, scale, wrong, softcap)) > 1e-3
    print(impl_cls.__name__, query_lens, f"window {window} softcap {softcap}: max error {err:.1e}")


def run_fp8(impl_cls, meta_cls, extra, query_lens, kv_cache_dtype):
    """An 8-bit cache (vLLM's `--kv-cache-dtype`): the sources' caches hold fp8(x / scale) codes (uint8, as vLLM
    allocates them) with a scale per layer and side; the layer reads them in place and must equal the same layer
    over an unquantised cache holding the dequantised values (checked against the reference above)."""
    from fusedkv.serving.paged_blocks import FP8_FORMATS, dequantize_fp8, quantize_fp8

    seq_lens = SEQ_LENS[:len(query_lens)]
    dev, _ = make_paged(seq_lens, H_KV, G, 2, 2, True, query_lens=query_lens, seed=3)
    fmt = FP8_FORMATS[kv_cache_dtype]
    scales = [(0.05, 0.2), (0.1, 0.03), (0.3, 0.07)]  # (k_scale, v_scale) of layers l0, l1, l2
    coded, plain = {}, {}
    for i, kv in enumerate(dev["layers"]):
        k_scale, v_scale = scales[i]
        codes = torch.cat([quantize_fp8(kv[..., :D], fmt, k_scale), quantize_fp8(kv[..., D:], fmt, v_scale)], -1)
        coded[f"l{i}"] = SimpleNamespace(kv_cache=codes.view(torch.uint8), _k_scale_float=scales[i][0],
                                         _v_scale_float=scales[i][1])
        plain[f"l{i}"] = SimpleNamespace(kv_cache=torch.cat([dequantize_fp8(codes[..., :D], scales[i][0]),
                                                             dequantize_fp8(codes[..., D:], scales[i][1])], -1),
                                         _k_scale_float=1.0, _v_scale_float=1.0)
    t = dev["q"].shape[0]
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = meta_cls(num_actual_tokens=t, max_query_len=max(query_lens), query_start_loc=starts,
                    max_seq_len=max(seq_lens), seq_lens=dev["seq_lens"], block_table=dev["block_table"],
                    slot_mapping=torch.zeros(t, dtype=torch.long), **extra)
    outputs = []
    for cache_dtype, layers in ((kv_cache_dtype, coded), ("auto", plain)):
        impl = impl_cls(num_heads=H_KV * G, head_size=D, scale=D**-0.5, num_kv_heads=H_KV, alibi_slopes=None,
                        sliding_window=None, kv_cache_dtype=cache_dtype)
        layer = CrossLayerAttention(impl, ["l1", "l2"], ["l0", "l1"])
        layer.take(KVSources((), tuple(dev["k_weights"]), (), tuple(dev["v_weights"])))
        select_paths([layer], torch.float32, torch.device("cpu"), block_size=16)
        output = torch.full_like(dev["q"], float("nan"))
        with override_forward_context(ForwardContext(no_compile_layers=layers, attn_metadata={n: meta for n in layers},
                                                     slot_mapping={})):
            layer.forward(None, dev["q"], None, None, None, meta, output)
        outputs.append(output)
    err = max_error(outputs[0], outputs[1])
    assert err < 1e-5, (impl_cls.__name__, kv_cache_dtype, err)
    print(impl_cls.__name__, query_lens, f"{kv_cache_dtype} cache ({layer.path} path): max error {err:.1e}")


triton_extra = dict(seq_threshold_3D=0, num_par_softmax_segments=0, softmax_segm_output=None, softmax_segm_max=None,
                    softmax_segm_expsum=None, causal=True)
for query_lens in (QUERY_LENS, [1, 1, 1]):  # a mixed batch; decode only (one kernel launch)
    for window, softcap in ((None, None), (8, 2.5)):
        run(FlashAttentionImpl, FlashAttentionMetadata, {}, query_lens, window, softcap)
        run(TritonAttentionImpl, TritonAttentionMetadata, triton_extra, query_lens, window, softcap)
run(FlashAttentionImpl, FlashAttentionMetadata, {}, [1, 1, 1], 8, 2.5, other_group="l2")
for kv_cache_dtype in ("fp8", "fp8_e5m2"):  # FlashAttention's impl refuses fp8 caches off a GPU; Triton's takes them
    run_fp8(TritonAttentionImpl, TritonAttentionMetadata, triton_extra, QUERY_LENS, kv_cache_dtype)
# ALiBi and sinks stay refused on GPU, with the message that says what the layers take.
for bad in (dict(alibi_slopes=[0.5] * (H_KV * G)), dict(sinks=torch.zeros(H_KV * G))):
    impl = TritonAttentionImpl(**{**dict(num_heads=H_KV * G, head_size=D, scale=D**-0.5, num_kv_heads=H_KV,
                                         alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto"), **bad})
    try:
        CrossLayerAttention(impl, ["l1", "l2"], ["l0", "l1"])
    except NotImplementedError as e:
        assert "no ALiBi or sinks" in str(e), e
    else:
        raise AssertionError(f"{bad} was not refused")
print("ALL OK")
