"""What `fusedkv serve` checks before vLLM starts, so that nothing it could know fails after start-up.

vLLM takes tens of seconds to start and some of its refusals come only at the first request (a head
size its CPU attention cannot run answers HTTP 500 once the server reports ready). Everything decidable
from the checkpoint, the flags and this machine is decided here, in the project's environment, in about
a second, each failure one line and exit 2 (`fusedkv.errors`):

  * the checkpoint: `fusedkv generate`'s checks, what the plugin serves (`plugin.check_servable`), a
    tokenizer, and finite weights (a NaN weight gives NaN logits: HTTP 200 with empty text otherwise);
  * vLLM's CPU attention backend: head sizes and block sizes it runs (`CPU_HEAD_SIZES`, `CPU_BLOCK_MULTIPLE`,
    vLLM 0.32's `CPUAttentionBackend`; tests/serving check them against the installed vLLM);
  * the address: resolved and bound exactly as vLLM binds it (port in use, a host that is not here);
  * the vLLM arguments after `--`: an option `fusedkv serve` sets itself is refused (it would silently
    disagree with fusedkv's), and the combinations the plugin refuses at load time are refused now;
  * the dtype: `auto` is the checkpoint's own dtype, so greedy output equals transformers' by default;
    serving below the checkpoint's precision is said in one warning line;
  * the chat template: the checkpoint's (`fusedkv train` saves one, `fusedkv convert` keeps the source's), else
    `fusedkv.data.tokenizer.DEFAULT_CHAT_TEMPLATE` (documented in docs/serving.md).
"""

from __future__ import annotations

import errno
import ipaddress
import json
import socket
from pathlib import Path

from ..errors import UsageError

# vLLM 0.32 CPUAttentionBackend.get_supported_head_sizes() and get_supported_kernel_block_sizes().
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
CPU_BLOCK_MULTIPLE = 32

# Precision order of the dtypes vLLM serves: a lower rank loses mantissa bits.
DTYPE_BITS = {"float32": 32, "bfloat16": 16, "float16": 16}


# vLLM options that `fusedkv serve` sets from its own flags (vLLM name -> fusedkv flag).
OWN_OPTIONS = {
    "--model": "CHECKPOINT", "--host": "--host", "--port": "--port", "--dtype": "--dtype",
    "--kv-cache-memory-bytes": "--kv-cache-memory", "--max-model-len": "--max-model-len",
    "--block-size": "--block-size", "--max-num-seqs": "--max-num-seqs",
    "--served-model-name": "--served-model-name", "--enforce-eager": "--enforce-eager",
    "--kv-sharing-fast-prefill": "--skip-prefill",
}


def check_prefill_skipping(config) -> None:
    """`--skip-prefill` needs layers without a cache after the last storage layer (paper Sec. 3.3): their
    outputs at prompt positions feed nothing but those positions' logits."""
    plan = config.plan
    if plan.first_skippable_layer >= plan.num_layers:
        raise UsageError(f"--skip-prefill: plan {config.kv_sharing} has no layer to skip (every layer up to the last "
                         "holds or writes KV cache); serve it without --skip-prefill")


def option_name(arg: str) -> str | None:
    """'--max_model_len=9' -> '--max-model-len' (vLLM accepts both spellings); None for a value."""
    if not arg.startswith("--") or arg == "--":
        return None
    name = arg.split("=", 1)[0]
    return "--" + name[2:].replace("_", "-")


def option_value(vllm_args: list[str], names: tuple[str, ...]) -> str | None:
    """The last value given to any of `names` in the pass-through arguments ('--x v' or '--x=v')."""
    value = None
    for i, arg in enumerate(vllm_args):
        name = option_name(arg) if arg.startswith("--") else arg
        if name in names:
            if "=" in arg:
                value = arg.split("=", 1)[1]
            elif i + 1 < len(vllm_args):
                value = vllm_args[i + 1]
    return value


def has_option(vllm_args: list[str], name: str) -> bool:
    return any(option_name(a) in (name, "--no-" + name[2:]) for a in vllm_args)


def check_vllm_args(vllm_args: list[str], config, cpu_build: bool) -> None:
    """Refuse pass-through arguments that duplicate fusedkv's own or that the plugin cannot run."""
    for arg in vllm_args:
        name = option_name(arg)
        if name is None:
            continue
        base = "--" + name[5:] if name.startswith("--no-") else name
        if base in OWN_OPTIONS:
            own = OWN_OPTIONS[base]
            how = "give the checkpoint directory" if own == "CHECKPOINT" else f"use fusedkv serve's own {own}"
            raise UsageError(f"{arg!r} after `--` duplicates an option fusedkv serve sets itself; {how} "
                             "(before `--`)")
    for names in (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp")):
        value = option_value(vllm_args, names)
        if value is not None and value.strip() != "1":
            raise UsageError(f"{names[0]} {value}: the fusedkv vLLM plugin runs on one device")
    cache_dtype = option_value(vllm_args, ("--kv-cache-dtype",))
    if cache_dtype not in (None, "auto", "float32", "bfloat16", "float16") and reads_other_layers(config):
        raise UsageError(f"--kv-cache-dtype {cache_dtype}: FusedKV reconstruction layers read unquantised caches; "
                         "serve with the default (auto)")
    if cache_dtype not in (None, "auto", "float32", "bfloat16", "float16") and getattr(config, "kv_lora_rank", None):
        raise UsageError(f"--kv-cache-dtype {cache_dtype}: the plugin's latent-attention (MLA) layers keep their "
                         "latents unquantised; serve with the default (auto)")
    if cpu_build and cache_dtype is not None and cache_dtype.startswith("fp8") and config.head_dim % 32:
        raise UsageError(f"--kv-cache-dtype {cache_dtype}: vLLM's CPU backend needs head_dim divisible by 32")


def reads_other_layers(config) -> bool:
    """Some reconstruction layer reads more than one layer's plain K and V (Lite, FusedKV, dense, custom)."""
    return any(not layer.stores and not (layer.k_sources == layer.v_sources and len(layer.k_sources) == 1
                                         and layer.k_fusion == layer.v_fusion == "reuse")
               for layer in config.plan.layers)


def implied_vllm_args(config, vllm_args: list[str], cpu_build: bool) -> list[str]:
    """vLLM options `fusedkv serve` adds for this model. On a GPU build, a hybrid of window and full layers
    with reconstruction layers that fuse (not plain reuse, which is vLLM's own KV sharing):
    `--disable-hybrid-kv-cache-manager`, since vLLM's hybrid manager may split the layers into KV-cache
    groups with separate block tables, and such a layer reads every source through its own
    (`fusedkv.serving.paged`). The CPU build keeps one group."""
    hybrid = "sliding_attention" in (getattr(config, "layer_types", None) or ())
    if (cpu_build or not hybrid or not reads_other_layers(config)
            or has_option(vllm_args, "--disable-hybrid-kv-cache-manager")):
        return []
    return ["--disable-hybrid-kv-cache-manager"]


def check_cpu_backend(config, block_size: int | None) -> None:
    """Head and block sizes vLLM's CPU attention runs; it accepts others at start-up and fails later."""
    if config.head_dim not in CPU_HEAD_SIZES and getattr(config, "kv_lora_rank", None) is None:  # MLA: vllm_mla
        raise UsageError(f"head_dim={config.head_dim}: vLLM's CPU attention runs head sizes "
                         f"{', '.join(map(str, CPU_HEAD_SIZES))} only (it would fail at the first request); "
                         "serve this model with `fusedkv generate`, or train one with such a head_dim")
    if block_size is not None and block_size % CPU_BLOCK_MULTIPLE:
        raise UsageError(f"--block-size {block_size}: vLLM's CPU backend needs a multiple of {CPU_BLOCK_MULTIPLE}")


def checkpoint_dtype(config) -> str:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    name = str(dtype).removeprefix("torch.")
    return name if name in DTYPE_BITS else "float32"


def resolve_dtype(requested: str, config) -> tuple[str, str | None]:
    """(dtype to serve in, warning or None). `auto` is the checkpoint's own dtype (vLLM's `auto` would run a
    float32 checkpoint in bfloat16 on CPU, and greedy tokens would then differ from transformers')."""
    own = checkpoint_dtype(config)
    if requested == "auto":
        return own, None
    if DTYPE_BITS[requested] < DTYPE_BITS[own]:
        return requested, (f"serving a {own} checkpoint in {requested}: outputs differ from transformers' and "
                           f"`fusedkv generate`'s (greedy tokens can change); --dtype {own} serves it exactly")
    return requested, None


def has_chat_template(path: Path) -> bool:
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((path / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def is_ipv6(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
    except ValueError:
        return False


def check_address(host: str, port: int) -> None:
    """Bind (host, port) as vLLM will (its `create_server_socket`: AF_INET unless an IPv6 literal,
    SO_REUSEADDR), then let it go: a port in use or a host that is not this machine fails now."""
    family = socket.AF_INET6 if is_ipv6(host) else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except socket.gaierror as e:
        raise UsageError(f"--host {host!r} is not an address or a name this machine resolves ({e.strerror})") from None
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise UsageError(f"port {port} on {host} is in use (another server?); choose another --port") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise UsageError(f"--host {host}: not an address of this machine, cannot listen on it") from None
        if e.errno == errno.EACCES:
            raise UsageError(f"--port {port}: binding it needs privileges; choose a port above 1023") from None
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
