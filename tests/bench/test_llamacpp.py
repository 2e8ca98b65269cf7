"""llama.cpp as an optional bench peer (fusedkv.speed.llamacpp): locating the converter in an sdist,
and, where llama-cpp-python and its sdist are installed, that the converted model reproduces
transformers' logits through the bindings (CPU-PEERS: f32 to ~1e-6)."""

import io
import os
import tarfile

import pytest
import torch

from fusedkv.speed import llamacpp
from fusedkv.speed.llamacpp import CONVERTER, SRC_ENV, available, find_converter


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
