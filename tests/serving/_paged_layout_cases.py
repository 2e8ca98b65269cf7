"""Run by test_paged_layout.py with the vLLM environment's Python: the gather of paged CPU cache blocks
returns exactly the tokens vLLM's own cache-write op stored, for every layout path (learned, plain,
transposed, AMX-packed, general index), dtype and head size the CPU backend takes."""

import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from fusedkv.serving.paged_blocks import block_layout, gather_blocks, split_cpu_kv_cache

torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for head_dim in (32, 64, 128):
        bs, heads, num_blocks = 32, 2, 9
        isa = _get_attn_isa(dtype, bs, head_dim)
        layouts = block_layout(isa, dtype, bs, head_dim)
        kv = torch.zeros(num_blocks, heads, bs, 2 * head_dim, dtype=dtype)
        key_cache, value_cache = split_cpu_kv_cache(kv)
        tokens = num_blocks * bs
        k, v = (torch.randn(tokens, heads, head_dim).to(dtype) for _ in range(2))
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, torch.arange(tokens), isa)
        blocks = torch.tensor([[3, 1, 4], [0, 8, 2]])
        for cache, written, layout in ((key_cache, k, layouts[0]), (value_cache, v, layouts[1])):
            want = torch.stack([torch.cat([written[b * bs:(b + 1) * bs] for b in row.tolist()]).transpose(0, 1)
                                for row in blocks])
            assert torch.equal(gather_blocks(cache, blocks, layout), want), (dtype, head_dim, layout)
            if layout is not None and head_dim == 32:  # the general index path agrees with the specialised one
                n = bs * head_dim
                found = torch.empty(n, dtype=torch.long)
                flat = cache[0, 0].reshape(-1)
                raw = written[:bs, 0].reshape(-1)  # block 0, head 0, plain (t, d) order
                for code in range(n):
                    found[code] = int((flat == raw[code]).nonzero()[0]) if (flat == raw[code]).sum() == 1 else -1
                if (found >= 0).all():  # random values are distinct almost surely; skip a rare collision
                    assert torch.equal(gather_blocks(cache, blocks, found), want)
        print(dtype, head_dim, isa, "ok")
print("ALL OK")
