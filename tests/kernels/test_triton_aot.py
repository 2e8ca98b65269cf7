"""Compile the decode kernels for a real GPU (sm_90, PTX -> cubin with the ptxas bundled in Triton).

The interpreter checks numerics but not code generation (layouts, tl.dot shapes, register limits).
Triton can compile for a target without a GPU or driver, so this catches kernels that would fail to
build on an H100/H200 on a CPU-only machine.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"), reason="interpreter is on"),
    pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION"),
]


def _compile(fn, sig_types: dict, consts: dict, num_warps: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {name: sig_types.get(name, "i32") for name in fn.arg_names}
    sig.update({k: "constexpr" for k in consts})
    src = ASTSource(fn, sig, constexprs=consts)
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    except FileNotFoundError as e:  # no bundled ptxas in this triton build
        pytest.skip(f"cannot compile offline: {e}")


# (dtype, HAS_K2/V2, weighted, USE_DOT, BLOCK_G, BLOCK_N, D, SINGLE_SPLIT, warps, dot precision)
CASES = [
    ("bf16", True, True, False, 1, 32, 128, False, 4, "default"),  # FusedKV, MHA
    ("bf16", False, False, False, 1, 64, 128, True, 4, "default"),  # plain MHA, one split
    ("bf16", True, True, True, 64, 32, 128, False, 8, "default"),  # FusedKV, H_q=128 / H_kv=2
    ("fp32", True, False, True, 16, 32, 64, False, 4, "ieee"),  # fp32 dot path
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-G{c[4]}-D{c[6]}-dot{int(c[3])}" for c in CASES])
def test_stage1_compiles_for_sm90(case):
    from fusedkv.kernels import triton_decode as td

    dtype, two, weighted, use_dot, block_g, block_n, d, single, warps, prec = case
    ptr = f"*{dtype}"
    types = {n: ptr for n in ("Q", "K1", "K2", "V1", "V2", "OUT")}
    types.update({n: "*fp32" for n in ("KW1", "KW2", "VW1", "VW2", "O_PART", "LSE_PART")})
    types.update(KV_START="*i64", KV_END="*i64", qk_scale="fp32")
    types.update({n: "i64" for n in ("stride_k1b", "stride_k2b", "stride_v1b", "stride_v2b")})
    consts = dict(HAS_K2=two, HAS_V2=two, HAS_KW1=weighted, HAS_KW2=weighted and two, HAS_VW1=weighted,
                  HAS_VW2=weighted and two, HAS_KV_START=True, HAS_KV_END=False, SINGLE_SPLIT=single,
                  USE_DOT=use_dot, DOT_PRECISION=prec, BLOCK_G=block_g, BLOCK_N=block_n, D=d)
    k = _compile(td._fused_decode_stage1, types, consts, warps)
    assert k.asm.get("cubin")


def test_combine_compiles_for_sm90():
    from fusedkv.kernels import triton_decode_blocks as td

    k = _compile(td._fused_decode_combine, {"O_PART": "*fp32", "LSE_PART": "*fp32", "OUT": "*bf16"},
                 {"BLOCK_S": 64, "D": 128}, 4)
    assert k.asm.get("cubin")
