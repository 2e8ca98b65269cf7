"""llama.cpp as an optional bench peer (fusedkv.speed.llamacpp, benchmarks/cpu_decode.py): locating the
converter in an sdist (or fetching it), the vanilla checkpoint export, llama.cpp's sequence state made
longer, the long-context cache fill, the ratio columns; and, where llama-cpp-python and its sdist are
installed, that the converted model reproduces transformers' logits through the bindings (CPU-PEERS: f32
to ~1e-6) and that the 4-bit files and the filled cache work."""

import importlib.util
import io
import os
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from fusedkv.speed import llamacpp
from fusedkv.speed.llamacpp import CONVERTER, SRC_ENV, available, find_converter, tile_seq_state

needs_llama = pytest.mark.skipif(available() is not None, reason="needs llama-cpp-python (pip install -e '.[bench]')")


def _bench():
    """benchmarks/cpu_decode.py as a module."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_decode.py"
    spec = importlib.util.spec_from_file_location("cpu_decode_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sdist(path, files):
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_converter_is_found_in_a_packed_or_unpacked_sdist(tmp_path, monkeypatch):
    archive = _sdist(tmp_path / "llama_cpp_python-9.9.9.tar.gz", {
        f"llama_cpp_python-9.9.9/vendor/llama.cpp/{CONVERTER}": "print('hi')\n",
        "llama_cpp_python-9.9.9/vendor/llama.cpp/conversion/__init__.py": "\n",
        "llama_cpp_python-9.9.9/vendor/llama.cpp/ggml/src/big.c": "int x;\n",  # not extracted
    })
    root = find_converter(archive, tmp_path / "cache")
    assert (root / CONVERTER).is_file() and (root / "conversion" / "__init__.py").is_file()
    assert not (root / "ggml").exists()
    assert find_converter(archive, tmp_path / "cache") == root  # unpacked once
    monkeypatch.setenv(SRC_ENV, str(root))
    assert find_converter() == root


def test_bad_sources_say_what_to_do(tmp_path, monkeypatch):
    monkeypatch.delenv(SRC_ENV, raising=False)
    with pytest.raises(ValueError, match="pip download --no-binary"):
        find_converter()
    with pytest.raises(ValueError, match="no such file"):
        find_converter(tmp_path / "missing.tar.gz")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=f"no {CONVERTER}"):
        find_converter(tmp_path / "empty")
    (tmp_path / "notar.tar.gz").write_text("x")
    with pytest.raises(ValueError, match="not a .tar.gz"):
        find_converter(tmp_path / "notar.tar.gz")
    with pytest.raises(ValueError, match="GGUF type"):
        llamacpp.convert_to_gguf(tmp_path, tmp_path / "x.gguf", "q4_k", tmp_path)


def test_sdist_fetch_reports_a_failed_download(tmp_path):
    """Without --llamacpp-src the benchmark fetches the sdist with pip; a failure says what to do instead
    (here pip is replaced by a command that fails, so nothing is downloaded)."""
    with pytest.raises(ValueError, match="could not download llama-cpp-python==.*--llamacpp-src"):
        llamacpp.fetch_sdist(tmp_path, python="/bin/false")
    (tmp_path / f"llama_cpp_python-{llamacpp.VERSION}.tar.gz").write_bytes(b"x")
    assert llamacpp.fetch_sdist(tmp_path, python="/bin/false").name.endswith(".tar.gz")  # present: no download


def _state(n, layers=2, krow=4, v_trans=1, el=2, width=3, seq=0):
    """A sequence state in llama.cpp's layout (llama_kv_cache::state_write) with recognisable bytes."""
    out = [struct.pack("<Iiii", 0x67677371, seq, 1, n)]
    out += [struct.pack("<iIi", p, 1, seq) for p in range(n)]
    out.append(struct.pack("<II", v_trans, layers))
    for layer in range(layers):
        out.append(struct.pack("<iQ", 1, krow) + bytes((layer * 16 + c) % 256 for c in range(n * krow)))
    for layer in range(layers):
        if v_trans:
            out.append(struct.pack("<iII", 1, el, width))
            out += [bytes(100 + layer * 10 + j for _ in range(n * el)) for j in range(width)]
        else:
            out.append(struct.pack("<iQ", 1, krow) + bytes(200 + c for c in range(n * krow)))
    return b"".join(out)


@pytest.mark.parametrize("v_trans", [0, 1])
def test_seq_state_is_tiled_to_more_cells(v_trans):
    n, cells, krow = 3, 7, 4
    big = tile_seq_state(_state(n, v_trans=v_trans, krow=krow), cells)
    want_k = (bytes(range(n * krow)) * 3)[:cells * krow]  # layer 0's K rows, repeated
    assert big == tile_seq_state(big, cells)  # a tiled state is a valid state of as many cells
    header = np.frombuffer(big, "<u4", 4)
    assert header[3] == cells
    meta = np.frombuffer(big, "<i4", 3 * cells, 16).reshape(cells, 3)
    assert (meta[:, 0] == np.arange(cells)).all() and (meta[:, 1] == 1).all()
    assert want_k in big
    with pytest.raises(ValueError, match="another format"):
        tile_seq_state(_state(n, v_trans=v_trans) + b"\0", cells)
    with pytest.raises(ValueError, match="unexpected"):
        moved = struct.pack("<iIi", 5, 1, 0)  # a cell out of order: not one prompt's cells
        tile_seq_state(_state(n, v_trans=v_trans).replace(struct.pack("<iIi", 1, 1, 0), moved), 4)


def _tiny_vanilla(tmp_path):
    from fusedkv.config import FusedKVConfig
    from fusedkv.model import FusedKVForCausalLM

    torch.manual_seed(0)
    cfg = FusedKVConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                        kv_sharing="vanilla")
    model = FusedKVForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "ck")
    return model, tmp_path / "ck"


def test_vanilla_checkpoint_exports_to_qwen3_with_equal_logits(tmp_path):
    from transformers import Qwen3ForCausalLM

    model, ck = _tiny_vanilla(tmp_path)
    (ck / "tokenizer.json").write_text("{}")
    out = llamacpp.export_vanilla_checkpoint(ck, tmp_path / "hf")
    hf = Qwen3ForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 300, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    assert (out / "tokenizer.json").is_file() and hf.config.num_key_value_heads == 2


def test_export_refuses_a_fused_plan(tmp_path):
    from fusedkv.config import FusedKVConfig
    from fusedkv.model import FusedKVForCausalLM

    cfg = FusedKVConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=2, head_dim=16, max_position_embeddings=32, kv_sharing="fusedkv")
    FusedKVForCausalLM(cfg).save_pretrained(tmp_path / "ck")
    with pytest.raises(ValueError, match="vanilla dense Qwen3 architecture only"):
        llamacpp.export_vanilla_checkpoint(tmp_path / "ck", tmp_path / "hf")


@pytest.mark.parametrize("plan", ["vanilla", "fusedkv-lite"])
def test_long_context_fill_decodes_like_generate(plan):
    """The --long rows' cache fill (the seed's K/V repeated): filled exactly to the seed's length it is the
    prefill, and decoding from it gives generate's greedy tokens; filled to 3x it decodes over 3x the keys."""
    from fusedkv.generation import generate
    from fusedkv.speed.inference import BenchShape, build_models

    bench = _bench()
    shape = BenchShape(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                       head_dim=16, vocab_size=256)
    model = build_models(shape, [plan], 128, "cpu", torch.float32, include_hf=False)[plan]
    row = dict(model=model, kv_dtype=torch.float32)
    seed = torch.randint(1, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    want = generate(model, seed, 6, weight_layout="auto").tokens[0, 24:].tolist()
    cache, token = bench.fill_ours(row, 24, seed, 6)
    times, tokens = bench.decode_ours(model, cache, token, 24, 5)
    assert [int(token)] + tokens == want and len(times) == 5
    cache, token = bench.fill_ours(row, 72, seed, 6)
    for buf in cache.keys.values():
        assert torch.equal(buf[:, :, 48:72], buf[:, :, :24])
    _, again = bench.decode_ours(model, cache, token, 72, 3)
    assert cache.get_seq_length() == 75 and len(again) == 3


def test_int4_rows_are_compared_with_both_q4_files_per_round():
    bench = _bench()
    assert bench.peer_of("vanilla w=int4 kv=bf16") == ["llama.cpp w=q4_0 kv=f16", "llama.cpp w=q4_k_m kv=f16"]
    assert bench.peer_of("fusedkv-lite w=f32 kv=f32") == ["llama.cpp w=f32 kv=f32"]

    def row(name, tpots):
        return dict(name=name, threads=1, batch=1, prompt=512, ceiling_gb_s=20.0, gb_s=10.0, ttft_s=1.0,
                    tpot_s=float(np.median(tpots)), runs=[dict(ttft=1.0, tpot=t) for t in tpots])

    rows = [row("vanilla w=int4 kv=bf16", [1.0, 2.0, 4.0]), row("llama.cpp w=q4_0 kv=f16", [2.0, 2.0, 2.0]),
            row("llama.cpp w=q4_k_m kv=f16", [1.0, 4.0, 4.0])]
    assert bench.round_ratio(rows[0], rows[2], "tpot") == 1.0  # rounds 1, 0.5, 1 (ratio of medians: 0.5)
    table = bench.format_rows(rows)
    assert "| 1.00 (w=q4_0 kv=f16), 1.00 (w=q4_k_m kv=f16) |" in table.splitlines()[2]



def test_available_explains_a_missing_install():
    why = available()
    try:
        import llama_cpp  # noqa: F401
        assert why is None
    except ImportError:
        assert "pip install" in why


@pytest.mark.manual
@pytest.mark.skipif(available() is not None or not os.environ.get(SRC_ENV),
                    reason=f"needs llama-cpp-python and its sdist in ${SRC_ENV}")
def test_converted_model_reproduces_transformers_logits(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=128,
                      tie_word_embeddings=False)
    hf = Qwen3ForCausalLM(cfg).eval()
    hf_dir = llamacpp.export_hf_checkpoint(hf, tmp_path / "hf", text_chars=200_000)
    root = find_converter(None, tmp_path)
    gguf = llamacpp.convert_to_gguf(hf_dir, tmp_path / "m.gguf", "f32", root)
    runner = llamacpp.LlamaCppRunner(gguf, n_ctx=64, threads=1, kv_type="f32")
    ids = torch.randint(1, 384, (1, 12)).tolist()[0]
    out = runner.generate(ids, 4)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0, 12:].tolist()
        runner.llm.reset()
        runner.llm.eval(ids)
        ours = torch.from_numpy(runner.logits_last().copy())
        want = hf(torch.tensor([ids])).logits[0, -1]
    runner.close()
    assert out["tokens"] == ref and len(out["step_s"]) == 3
    assert (ours - want).abs().max() < 1e-3


@pytest.mark.manual
@pytest.mark.skipif(available() is not None or not os.environ.get(SRC_ENV),
                    reason=f"needs llama-cpp-python and its sdist in ${SRC_ENV}")
def test_q4_files_window_logits_and_a_filled_cache(tmp_path):
    """llama.cpp's quantizer writes Q4_0 / Q4_K_M files a quarter the f32 size or less; the all-position
    logits of a window match transformers at f32; a cache set from its own state decodes as after the
    prompt itself, and one filled 3x longer decodes from there."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=64, max_position_embeddings=256,
                      tie_word_embeddings=False)
    hf = Qwen3ForCausalLM(cfg).eval()
    hf_dir = llamacpp.export_hf_checkpoint(hf, tmp_path / "hf", text_chars=200_000)
    root = find_converter(None, tmp_path)
    f32 = llamacpp.convert_to_gguf(hf_dir, tmp_path / "m-f32.gguf", "f32", root)
    for ty in llamacpp.QUANT_TYPES:
        q = llamacpp.convert_to_gguf(hf_dir, tmp_path / f"m-{ty}.gguf", ty, root)
        assert llamacpp.gguf_weight_nbytes(q) < llamacpp.gguf_weight_nbytes(f32) / 4
    ids = list(range(1, 33))
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(llamacpp.window_logits(f32, [ids])[0] - want).max() < 1e-3
    runner = llamacpp.LlamaCppRunner(f32, n_ctx=256, threads=1, kv_type="f32", n_batch=32)
    runner.llm.eval(ids + [7])
    direct = runner.logits_last().copy()
    runner.fill_cache(32, ids)
    runner.llm.eval([7])
    assert np.abs(runner.logits_last() - direct).max() < 1e-4
    runner.fill_cache(96, ids)
    assert runner.llm.n_tokens == 96 and len(runner.decode_from(96, 7, 3)) == 3
    runner.close()
