"""The presets: model sizes with the training recipe that goes with them, as YAML files.

Presets (fusedkv/train/presets/*.yaml; `extends: _paper` shares the paper's recipe)
-------------------------------------------------------------------------------------
* Paper sizes (App. A.2, Table 4): `332m`, `650m`, `1.5b`, `4b` - vocabulary 128,000, context 8192,
  RoPE base 10,000, untied embeddings, batch 512 sequences, AdamW (0.9, 0.95), weight decay 0.1, clip
  1.0, 2000 warm-up steps, cosine 3e-4 -> 3e-5, and the paper's token budgets. The paper does not give
  the MLP width; we use Qwen3's choice: 3 x hidden (Qwen3-0.6B/1.7B use exactly 3x), and 9728 for 4B
  (Qwen3-4B's width, 3.8x). Counting one embedding matrix but not the LM head, that gives 295M / 687M /
  1.57B / 3.96B parameters for vanilla (the last two match the paper's names; the paper's "332M" is
  exactly what a 4x MLP would give, so its MLP may be wider - set `model.intermediate_size=4096`).
* `tiny`: the default CPU run (`fusedkv train`): 4 layers, hidden 192, vocab 4096, context 256, 600
  steps of 2048 tokens (1.2M tokens) on the built-in corpus.
* `nano`: for tests: 4 layers, hidden 64, vocab 512, context 64, 8 steps, gradient accumulation 2.
"""

from __future__ import annotations

from importlib import resources

import yaml


def _load_presets() -> dict[str, dict]:
    files = {p.name[: -len(".yaml")]: p for p in resources.files(__package__).joinpath("presets").iterdir()
             if p.name.endswith(".yaml")}

    def load(name: str) -> dict:
        d = yaml.safe_load(files[name].read_text()) or {}
        parent = d.pop("extends", None)
        if parent is None:
            return d
        base = load(parent)
        return {**base, **d, "model": {**base.get("model", {}), **d.get("model", {})}}

    presets = {name: load(name) for name in files if not name.startswith("_")}
    # Smallest first (the order --help lists them in).
    size = {n: p["model"]["num_hidden_layers"] * p["model"]["hidden_size"] for n, p in presets.items()}
    return dict(sorted(presets.items(), key=lambda kv: size[kv[0]]))


PRESETS: dict[str, dict] = _load_presets()
PRESET_NAMES = tuple(PRESETS)
