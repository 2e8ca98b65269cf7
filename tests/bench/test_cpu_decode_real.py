"""benchmarks/cpu_decode_real.py (`cpu_decode.py --model`) without llama.cpp: GGUF files of llama.cpp's converter
are renamed into place only when whole and reused by the next run, the shipped file is named by its own weight
type, quality rows are measured once per work directory, and the table puts quality next to every row."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from fusedkv.speed import llamacpp

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def real(monkeypatch):
    """benchmarks/cpu_decode_real.py as a module (it imports its sibling cpu_decode by name)."""
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("cpu_decode_real_bench", BENCH / "cpu_decode_real.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_converter(root: Path, fail: bool) -> Path:
    """A stand-in for llama.cpp's converter tree (the wrapper patches conversion.base.TextModel): it writes
    half a file at --outfile, then fails or finishes it."""
    (root / "conversion").mkdir(parents=True)
    (root / "conversion" / "__init__.py").write_text("")
    (root / "conversion" / "base.py").write_text(
        "class TextModel:\n    def get_vocab_base_pre(self, tokenizer):\n        raise NotImplementedError\n")
    (root / llamacpp.CONVERTER).write_text(
        "import sys\nout = sys.argv[sys.argv.index('--outfile') + 1]\nopen(out, 'wb').write(b'GGUF half')\n"
        + ("sys.exit('out of memory')\n" if fail else "open(out, 'ab').write(b' and the rest')\n"))
    return root


def test_a_converted_file_appears_only_whole_and_is_reused(tmp_path):
    out = tmp_path / "model-f16.gguf"
    failing = _fake_converter(tmp_path / "failing", fail=True)
    with pytest.raises(RuntimeError, match="out of memory"):
        llamacpp.convert_to_gguf(tmp_path, out, "f16", failing)
    assert not out.exists()  # a killed or failed conversion leaves nothing a later run would take as done
    good = _fake_converter(tmp_path / "good", fail=False)
    assert llamacpp.convert_to_gguf(tmp_path, out, "f16", good) == out
    assert out.read_bytes() == b"GGUF half and the rest"
    assert llamacpp.convert_to_gguf(tmp_path, out, "f16", failing) == out  # present: not converted again


def test_the_shipped_file_is_named_by_its_weight_type(tmp_path, real):
    from gguf import GGUFWriter, LlamaFileType

    path = tmp_path / "shipped.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_file_type(LlamaFileType.MOSTLY_Q4_1)
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert real.gguf_file_type(str(path)) == "q4_1"
    assert "llama.cpp w=q4_1 kv=f16" in real.peers("vanilla w=int4 kv=f16")
    assert real.peers("fusedkv w=f16 kv=f16") == ["llama.cpp w=f16 kv=f16"]


def _tiny(seed):
    from fusedkv.config import FusedKVConfig
    from fusedkv.model import FusedKVForCausalLM

    torch.manual_seed(seed)
    cfg = FusedKVConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, head_dim=16, max_position_embeddings=64, kv_sharing="vanilla")
    return FusedKVForCausalLM(cfg).eval()


def test_quality_is_measured_once_per_row_and_read_back(tmp_path, real):
    ref, other = _tiny(0), _tiny(1)
    windows = [("prose", torch.randint(0, 64, (1, 17))), ("code", torch.randint(0, 64, (1, 17)))]
    ours = {"vanilla w=f32 kv=f32": dict(model=ref), "vanilla w=f32 kv=f16": dict(model=ref),
            "other w=f32 kv=f16": dict(model=other)}
    store = tmp_path / "quality.json"
    sources = {"vanilla": "hf", "other": "ck-a"}
    got = real.quality(ours, {}, windows, ref, sources, store)
    assert set(got) == {"vanilla w=f32 kv=f16", "other w=f32 kv=f16"}  # the cache's dtype: no second forward
    assert got["vanilla w=f32 kv=f16"]["top1"] == 1.0 and abs(got["vanilla w=f32 kv=f16"]["kl"]) < 1e-9
    assert got["other w=f32 kv=f16"]["top1"] < 1.0 and got["other w=f32 kv=f16"]["kl"] > 0
    assert set(got["other w=f32 kv=f16"]["ppl"]) == {"prose", "code"}

    def broken(ids):
        raise AssertionError("measured again")

    again = real.quality({n: dict(model=broken) for n in ours}, {}, windows, broken, sources, store)
    assert again == got  # read back: no model runs
    moved = real.quality({"other w=f32 kv=f16": dict(model=ref)}, {}, windows, ref, {"other": "ck-b"}, store)
    assert moved["other w=f32 kv=f16"]["top1"] == 1.0  # another checkpoint for the plan: measured anew


def test_the_table_shows_quality_and_same_bits_ratios(real):

    def row(name, tpot):
        return dict(name=name, threads=1, batch=1, prompt=512, ttft_s=1.0, tpot_s=tpot,
                    runs=[dict(ttft=1.0, tpot=tpot)])

    q = dict(ppl={"prose": 13.0}, top1=0.9, kl=0.01)
    rows = [row("vanilla w=int4 kv=f16", 0.02), row("llama.cpp w=q4_0 kv=f16", 0.04)]
    result = dict(texts=["/x/prose.txt"], rows=rows,
                  quality={"vanilla w=int4 kv=f16": q, "llama.cpp w=q4_0": dict(q, ppl={"prose": 14.0}),
                           "vanilla w=f32 kv=f16": dict(ppl={"prose": 12.5}, top1=1.0, kl=0.0)})
    lines = real.table(result).splitlines()
    assert "| 0.50 (q4_0) | 13.00 (+4.0%) | 0.900 | 0.0100 |" in lines[2]
    assert lines[3].endswith("| - | - | 14.00 (+12.0%) | 0.900 | 0.0100 |")
