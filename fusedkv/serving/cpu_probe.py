"""Ask the installed vLLM whether its CPU attention runs a layer shape on this processor, by running it.

vLLM's CPU backend lists head sizes (`CPUAttentionBackend.get_supported_head_sizes()`) that are not what its
compiled kernels run: vLLM 0.32 lists 32, 64, 80, ... and not 48, yet runs head_dim 48 (its "vec16" ISA),
while head_dim 16, also "vec16", fails at the first request ("Unsupported CPU attention configuration"). An
fp8 cache is refused on processors without AVX-512 or AMX, and its AVX2 extension has no fp8 kernels at all.
So the answer comes from the kernels themselves: the ISA vLLM's metadata builder would pick
(`_get_attn_isa`), vLLM's own cache write, scheduler metadata and attention op over a prefill of a few
tokens and a decode step, checked against plain attention on what the cache holds. Whatever fails, or
answers wrong, is refused with vLLM's own words.

Runs inside the vLLM environment: `fusedkv serve`'s preflight as `python -m fusedkv.serving.cpu_probe JSON`
(about a vLLM import's time), and the vLLM model while it loads (`vllm_model.check_backend_runs`).
"""

from __future__ import annotations

import json
import sys

import torch

# vLLM's default CPU cache block (`fusedkv serve` without --block-size) and the backend's block multiple.
DEFAULT_BLOCK_SIZE = 128
BLOCK_MULTIPLE = 32


def attention_runs(head_dim: int, num_heads: int, num_kv_heads: int, dtype: str, block_size: int,
                   kv_cache_dtype: str = "auto") -> str | None:
    """None when vLLM's CPU attention runs this shape here and gives plain attention's answer, else why not."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    torch_dtype = getattr(torch, dtype)
    if block_size % BLOCK_MULTIPLE:
        return f"vLLM's CPU backend needs a block size that is a multiple of {BLOCK_MULTIPLE}"
    try:
        isa = _get_attn_isa(torch_dtype, block_size, head_dim, kv_cache_dtype)
        gen = torch.Generator().manual_seed(0)
        lens = [5, block_size + 3]  # a prefill chunk of 5 tokens, and one decode row past a block edge
        q_lens = [5, 1]
        num_blocks = 4
        cache_dtype = torch_dtype if kv_cache_dtype in ("auto", dtype) else torch.uint8
        kv = torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_dim, dtype=cache_dtype)
        key_cache, value_cache = kv.view(num_blocks, num_kv_heads, 2 * block_size, head_dim).chunk(2, dim=2)
        block_table = torch.tensor([[0, 3], [2, 1]], dtype=torch.int32)
        keys = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(torch_dtype) for n in lens]
        values = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(torch_dtype) for n in lens]
        slots = torch.cat([block_table[r, torch.arange(n) // block_size].long() * block_size
                           + torch.arange(n) % block_size for r, n in enumerate(lens)])
        ops.cpu_attn_reshape_and_cache(torch.cat(keys), torch.cat(values), key_cache, value_cache, slots, isa,
                                       kv_cache_dtype=kv_cache_dtype)
        query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(torch_dtype)
        query_start_loc = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=2, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, seq_lens=seq_lens,
            dtype=torch_dtype, query_start_loc=query_start_loc, causal=True, sliding_window_size=-1, isa=isa,
            enable_kv_split=False, kv_cache_dtype=kv_cache_dtype)
        out = torch.empty_like(query)
        scale = head_dim ** -0.5
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=query_start_loc,
            seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=block_table, softcap=0.0, scheduler_metadata=metadata, s_aux=None,
            kv_cache_dtype=kv_cache_dtype)
    except (RuntimeError, NotImplementedError, ValueError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    # Plain attention on the K/V written (an 8-bit cache's rounding is within the tolerance below).
    want = []
    for r, (k, v) in enumerate(zip(keys, values)):
        q = query[query_start_loc[r]:query_start_loc[r + 1]].float().transpose(0, 1)  # [H, t, D]
        k = k.float().transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, 0)
        v = v.float().transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, 0)
        t, s = q.shape[1], k.shape[1]
        mask = torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]
        want.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
                    .transpose(0, 1))
    err = (out.float() - torch.cat(want)).abs().max().item()
    tolerance = 1e-3 if torch_dtype == torch.float32 and cache_dtype == torch_dtype else 0.15
    if not err <= tolerance:
        return f"its CPU attention runs but answers wrong for this shape (max error {err:.3g} against plain attention)"
    return None


def main(argv: list[str]) -> int:
    """argv[0]: JSON of `attention_runs`' arguments; prints JSON {"error": None or the reason}."""
    args = json.loads(argv[0])
    print(json.dumps({"error": attention_runs(**args)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
