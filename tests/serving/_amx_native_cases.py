"""Run by test_paged_layout.py with the vLLM environment's Python (argv: checkpoint directories of plans whose
reconstruction layers read two K sources): vLLM's "amx" ISA (bfloat16 caches on processors with AMX tiles) packs
its blocks exactly as the native paged kernel reads them, the kernel reads blocks vLLM's own op wrote, the
selection gives such layers the kernel, and a FusedKV model served in bfloat16 gives the same greedy tokens
through the kernel as through the gathered path."""

import gc
import os
import sys

import torch
from vllm import _custom_ops as ops

from fusedkv.engine.selection import select_paged_attention
from fusedkv.kernels import native
from fusedkv.kernels.reference import materialized_attention
from fusedkv.serving.paged_blocks import (
    AMX_PACKED_KEYS,
    AMX_PACKED_VALUES,
    block_layout,
    cpu_cache_layout,
    kernel_layout,
    layout_index,
    split_cpu_kv_cache,
)
from fusedkv.serving.paged_native import native_paged_attention, query_rows

BF16 = torch.bfloat16
AMX = [AMX_PACKED_KEYS, AMX_PACKED_VALUES]


def named(layout) -> list:
    return [side if side is None or isinstance(side, str) else "a general index" for side in layout]


# 1. The packing, written out here independently of paged_blocks.py: vLLM's layout must be it (block_layout names it
#    only when the index it learned from vLLM's write op equals paged_blocks.layout_index, checked against these
#    formulas).
for bs in (32, 64):
    for head_dim in (32, 64, 128):
        learned = named(block_layout("amx", BF16, bs, head_dim))
        assert learned == AMX, (bs, head_dim, learned)
        t, d = torch.arange(bs)[:, None], torch.arange(head_dim)[None, :]
        keys = (t // 16) * (16 * head_dim) + (d // 2) * 32 + (t % 16) * 2 + d % 2  # [bs/16][D/2][16 tokens][2 channels]
        values = (d // 16) * (bs * 16) + (t // 2) * 32 + (d % 16) * 2 + t % 2  # [D/16][bs/2][16 channels][2 tokens]
        assert torch.equal(layout_index(AMX_PACKED_KEYS, bs, head_dim), keys.reshape(-1))
        assert torch.equal(layout_index(AMX_PACKED_VALUES, bs, head_dim), values.reshape(-1))
print("layout ok")

# 2. The kernel over caches vLLM's op wrote (slots it did not write hold NaN): decode rows, a prefill chunk
#    mid-sequence, a one-token sequence, odd lengths; 1-2 weighted K and V sources; float64 reference.
g = torch.Generator().manual_seed(0)
bs, D, H_KV, H_Q = 32, 64, 2, 8
seqs = [(70, 1), (40, 5), (1, 1), (33, 3)]  # (length after this step, query tokens)
max_blocks = 3
num_blocks = len(seqs) * max_blocks + 2
perm = torch.randperm(num_blocks, generator=g).tolist()
tables = [perm[r * max_blocks:(r + 1) * max_blocks] for r in range(len(seqs))]
sources = []
for _ in range(2):
    key_cache, value_cache = split_cpu_kv_cache(torch.full((num_blocks, H_KV, bs, 2 * D), float("nan"), dtype=BF16))
    tokens = []
    for r, (s, _) in enumerate(seqs):
        k, v = (torch.randn(s, H_KV, D, generator=g).to(BF16) for _ in range(2))
        slots = torch.tensor([tables[r][i // bs] * bs + i % bs for i in range(s)])
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, "amx")
        tokens.append((k, v))
    sources.append((key_cache, value_cache, tokens))
layout = kernel_layout(block_layout("amx", BF16, bs, D))
assert layout == native.PAGED_AMX, layout
q_lens = [t for _, t in seqs]
qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
seq_lens = torch.tensor([s for s, _ in seqs], dtype=torch.int32)
q = torch.randn(sum(q_lens), H_Q, D, generator=g)
for n_k, n_v in ((2, 2), (2, 1), (1, 2)):
    kw = [torch.rand(H_KV, D, generator=g) + 0.5 for _ in range(n_k)]
    vw = [torch.rand(H_KV, D, generator=g) + 0.5 for _ in range(n_v)]
    out = native_paged_attention(q, [src[0] for src in sources[:n_k]], kw, [src[1] for src in sources[:n_v]], vw,
                                 query_rows(qsl, seq_lens, q.shape[0]), torch.tensor(tables, dtype=torch.int32),
                                 D**-0.5, layout, torch.full_like(q, float("nan")))
    for r, (s, t) in enumerate(seqs):
        ks = [sources[i][2][r][0].double().transpose(0, 1)[None] for i in range(n_k)]
        vs = [sources[i][2][r][1].double().transpose(0, 1)[None] for i in range(n_v)]
        qr = q[qsl[r]:qsl[r + 1]].double().transpose(0, 1)[None]
        mask = torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]
        want = materialized_attention(qr, ks, [w.double() for w in kw], vs, [w.double() for w in vw], mask=mask,
                                      scale=D**-0.5)
        torch.testing.assert_close(out[qsl[r]:qsl[r + 1]].double(), want[0].transpose(0, 1), atol=2e-5, rtol=2e-5)
print("kernel over vLLM-written blocks ok")

# 3. The selection: a bf16 model on this processor gets AMX-packed caches; a two-K-source layer gets the kernel.
cache_layout = cpu_cache_layout(BF16, BF16, "auto", 32, 32)
assert named(cache_layout) == AMX, named(cache_layout)
assert select_paged_attention(["l0", "l1"], ["l0", "l1"], gpu=False, head_dim=32, device=torch.device("cpu"),
                              dtype=BF16, query_dtype=BF16, native_layout=kernel_layout(cache_layout)) == "native"
print("selection ok")


# 4. Served end to end in bfloat16: the kernel (selected) against the gathered path (the kernels switched off).
def attention_paths(model) -> list:
    return [getattr(getattr(getattr(layer.self_attn, "attn", None), "impl", None), "path", None)
            for layer in model.model.layers]


def serve(model: str, prompts: list[list[int]], kernels: bool) -> tuple[list, list]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    before = os.environ.get("FUSEDKV_NATIVE_KERNELS")
    os.environ["FUSEDKV_NATIVE_KERNELS"] = "1" if kernels else "0"
    native.redecide()
    try:
        llm = LLM(model=model, dtype="bfloat16", block_size=32, kv_cache_memory_bytes=64 << 20, enforce_eager=True,
                  seed=0, enable_prefix_caching=False, skip_tokenizer_init=True)
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        paths = llm.apply_model(attention_paths)[0]
        del llm
        gc.collect()
    finally:
        if before is None:
            os.environ.pop("FUSEDKV_NATIVE_KERNELS")
        else:
            os.environ["FUSEDKV_NATIVE_KERNELS"] = before
        native.redecide()
    return [list(o.outputs[0].token_ids) for o in outputs], paths


os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: the switch reaches it
prompts = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (5, 33, 70, 17, 64, 2)]
for model in sys.argv[1:]:
    fast, fast_paths = serve(model, prompts, kernels=True)
    slow, slow_paths = serve(model, prompts, kernels=False)
    assert "native" in fast_paths and "native" not in slow_paths and "gathered" in slow_paths, (fast_paths, slow_paths)
    assert fast == slow, (model, fast, slow)
    print(model, fast_paths, "greedy tokens equal")
print("ALL OK")
