"""Serving FusedKV checkpoints on vLLM, as a plugin (no fork, no server of our own).

vLLM lives in its own environment (it pins an older transformers than the project does; see
`scripts/install-vllm.sh`). The pieces:

  * `plugin`: the `vllm.general_plugins` entry point. In every vLLM process it registers the config
    with transformers' `AutoConfig` and the model class with vLLM's `ModelRegistry`.
  * `vllm_model`: the model written with vLLM's layers. Storage layers own cache blocks; every other
    layer is a vLLM `Attention` with `kv_sharing_target_layer_name`, so it is given no blocks.
  * `paged`: attention of reconstruction layers that read two layers' paged caches (Lite, FusedKV,
    custom source maps), through vLLM's own CPU attention op where the math allows it.
  * `command`: `fusedkv serve`, run from the project's environment; it checks the checkpoint and starts
    vLLM's OpenAI-compatible server with the vLLM environment's Python.
  * `offline`: runs checkpoints through vLLM's offline engine and prints JSON (tests, benchmarks).

Only `command` is imported by the `fusedkv` CLI; nothing here imports vLLM at package import time.
"""
