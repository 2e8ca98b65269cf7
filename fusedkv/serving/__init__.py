"""Serving FusedKV checkpoints on vLLM, as a plugin (no fork, no server of our own).

vLLM lives in its own environment (it pins an older transformers than the project does; see
`scripts/install-vllm.sh`). The pieces:

  * `plugin`: the `vllm.general_plugins` entry point. In every vLLM process it registers the config
    with transformers' `AutoConfig` and the model class with vLLM's `ModelRegistry`.
  * `vllm_model`: the model written with vLLM's layers. Storage layers own cache blocks; every other
    layer is a vLLM `Attention` with `kv_sharing_target_layer_name`, so it is given no blocks.
  * `paged`: attention of reconstruction layers that read two layers' paged caches (Lite, FusedKV,
    custom source maps): vLLM's own CPU attention op for one K source, the native block-table kernel
    (`fusedkv/kernels/cpu_paged_attention.c`) for two, both over the blocks in place; the paged Triton
    kernel on GPU backends. Each layer's path is chosen once, by the engine's selection, when the
    model loads its weights (`paged.select_paths`).
  * `paged_blocks`: how vLLM's cache blocks are laid out and read: each backend's cache split into keys and
    values, the CPU backend's block layout (learned from its own cache-write op), blocks gathered in token order.
  * `command`: `fusedkv serve`, run from the project's environment; it checks the checkpoint and starts
    vLLM's OpenAI-compatible server with the vLLM environment's Python.
  * `preflight`: what `fusedkv serve` refuses before vLLM starts (head/block sizes, address, options).
  * `supervisor`: the hold on vLLM's processes (group, watchdog, exit status, the ready line).
  * `offline`: runs checkpoints through vLLM's offline engine and prints JSON (tests, benchmarks).

Only `command` is imported by the `fusedkv` CLI; nothing here imports vLLM at package import time.
"""
