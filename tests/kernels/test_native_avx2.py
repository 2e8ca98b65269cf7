"""The native kernels built as for a processor with AVX2 only (no AVX-512, no AVX-512 BF16), on this machine:
processors of this kind come with or without AVX-512, and `-march=native` picks for the one it builds on
(the bf16 / int8 / int4 block products take their AVX2 loops there).
A compiler wrapper turns `-march=native` into `-march=x86-64-v3` (AVX2 + FMA + F16C); in a fresh process with its
own cache, the library must report AVX2 block products, and every kernel and the native decode step must still
match the float64 reference and the model's own forward."""

import os
import platform
import shutil
import subprocess
import sys
import textwrap

import pytest

CHECK = textwrap.dedent("""
    import os
    import torch
    from fusedkv.cache import StaticKVCache
    from fusedkv.generation import generate
    from fusedkv.kernels import native
    from fusedkv.engine.native_step import NativeDecodeStep
    from fusedkv.engine.precision import quantize_int4, reduce_precision
    from fusedkv.kernels import cpu_gemv
    from fusedkv.engine.selection import set_decode_layout
    from tests.conftest import tiny_model

    lib, isa = native.library(), os.environ["EXPECTED_BLOCKS_ISA"] or None
    assert lib is not None and lib.blocks_isa == isa, f"expected {isa} block products, got {lib and lib.blocks_isa}"
    for plan in ("vanilla", "fusedkv", "fusedkv-lite"):
        model = tiny_model(plan)
        set_decode_layout(model, "packed")
        ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(0))
        cache = StaticKVCache(model.config, 2, 12)
        with torch.inference_mode():
            model(ids[:, :6], cache=cache, use_cache=True)
            step = NativeDecodeStep(model, cache.keys, cache.values, 2)
            got = []
            for i in range(6, 12):
                got.append(step(ids[:, i : i + 1], None, cache.get_seq_length()))
                cache.advance(1)
            full = model(ids).logits[:, 6:]
        err = (torch.cat(got, 1) - full).abs().max() / full.abs().max()
        assert err < 2e-5, (plan, float(err))
        prompt = ids[:, :5]
        assert torch.equal(generate(model, prompt, 6).tokens, generate(model, prompt, 6, native_step=False).tokens)
    # bf16 / int8 / f16 blocks widened to f32 on AVX2, against float64 over the same rounded operands; decoding too
    from tests.kernels import test_cpu_gemv as gemv
    for rows in (1, 2, 7) if isa else ():
        for shape in ((16, 3), (48, 37), (1536, 512)):
            gemv.test_bf16_blocks_match_the_float64_product_of_the_rounded_operands(rows, *shape)
            gemv.test_int8_blocks_match_the_float64_product(rows, *shape)
            gemv.test_f16_blocks_match_the_float64_product(rows, *shape)
    assert lib.f16_blocks == bool(isa)  # f16 blocks need AVX2 + F16C: the v3 build has them, v2 not
    for fmt in ("bfloat16", "int8", "float16"):
        model = reduce_precision(tiny_model("fusedkv"), fmt)
        prompt = ids[:, :5]
        assert torch.equal(generate(model, prompt, 6).tokens, generate(model, prompt, 6, native_step=False).tokens)
    # int4 blocks: the AVX2 loop (the portable one without AVX2), against float64 over the same integers and rounded x
    for out_f, in_f in ((16, 3), (48, 33), (96, 95)):
        q, s = quantize_int4(torch.randn(out_f, in_f))
        packed, scales = cpu_gemv.to_int4_blocks(q, s)
        x = torch.randn(5, in_f).bfloat16().double()
        w = q.double() * s.double().repeat_interleave(32, 1)[:, :in_f]
        err = (cpu_gemv.linear_int4(x.float(), packed, scales, in_f).double() - x @ w.T).abs().max()
        assert err <= 1e-6 * (x.abs() @ w.abs().T).max(), (out_f, in_f, float(err))
    model = reduce_precision(tiny_model("fusedkv"), "int4")
    prompt = ids[:, :5]
    assert torch.equal(generate(model, prompt, 6).tokens, generate(model, prompt, 6, native_step=False).tokens)
    if isa is None:  # the portable build: the int4 loop and decoding were its parts under test
        print("ok")
        raise SystemExit
    # one-token attention over a long 16-bit cache: the AVX2 vector path (16-wide chunks) and the portable loops (40)
    from tests.kernels import test_cpu_attention as att
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for d, h_q, h_kv in ((64, 8, 2), (48, 3, 3), (40, 4, 4)):
            att.test_long_caches_match_the_float64_reference(dtype, d, h_q, h_kv, 2)
    # the KIVI cache read in place (cpu_kivi_attention.c): its AVX2 loops (64-channel heads), its portable ones
    from tests.kernels import test_kivi_native as kivi
    for bits in (2, 4):
        for shape in kivi.SHAPES:
            kivi.test_attention_matches_float64(bits, "2R+3", shape, "fusedkv")
            for per_kv in (1, 3):  # MHA's constant-group loops, a pair of query heads and one alone
                kivi.test_attention_query_heads_per_kv_head(bits, per_kv, shape)
        for layout in kivi.LAYOUTS:  # its loops over whole 16-byte units (cpu_kivi_avx2.h), and what they leave
            kivi.test_attention_vector_layouts(bits, layout, "2R+3")
        kivi.test_native_step_matches_the_forward("fusedkv", bits, 2, {})
        kivi.test_generate_same_tokens_with_and_without_the_native_step("fusedkv", bits, 3, {})
    print("ok")
""")


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64" or shutil.which("cc") is None,
                    reason="the AVX2 build is checked on x86-64 Linux with a C compiler")
@pytest.mark.slow
@pytest.mark.parametrize("march, isa", [("x86-64-v3", "avx2"), ("x86-64-v2", "")])
def test_avx2_build_matches_the_forward(tmp_path, march, isa):
    """x86-64-v3: AVX2 + FMA + F16C, the AVX2 loops; x86-64-v2: none of them, the portable loops."""
    wrapper = tmp_path / "cc"
    wrapper.write_text(f'#!/bin/bash\nargs=()\nfor a in "$@"; do [ "$a" = "-march=native" ] && a="-march={march}"; '
                       f'args+=("$a"); done\nexec {shutil.which("cc")} "${{args[@]}}"\n')
    wrapper.chmod(0o755)
    env = {**os.environ, "CC": str(wrapper), "FUSEDKV_CACHE": str(tmp_path / "cache"), "FUSEDKV_NATIVE_KERNELS": "1",
           "EXPECTED_BLOCKS_ISA": isa}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", CHECK], env=env, cwd=root, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
    built = list((tmp_path / "cache").rglob("*.so"))
    assert len(built) == 1  # built with the wrapper, into the test's own cache
