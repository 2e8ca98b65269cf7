"""What `fusedkv serve` checks before vLLM starts, so that nothing it could know fails after start-up.

vLLM takes tens of seconds to start and some of its refusals come only at the first request (a head
size its CPU attention cannot run answers HTTP 500 once the server reports ready). Everything decidable
from the checkpoint, the flags and this machine is decided here, in the project's environment, in about
a second, each failure one line and exit 2 (`fusedkv.errors`):

  * the checkpoint: `fusedkv generate`'s checks, what the plugin serves (`plugin.check_servable`), a
    tokenizer, and finite weights (a NaN weight gives NaN logits: HTTP 200 with empty text otherwise);
  * vLLM's CPU attention backend: whether its kernels run this model's head size, dtype, block size and
    cache dtype on this processor, asked of the installed vLLM by running them (`cpu_probe`: its listed head
    sizes are not what it runs; a few seconds, a vLLM import);
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
import subprocess
from pathlib import Path

from ..errors import UsageError
from .parallel import rank_heads

# vLLM 0.32 CPUAttentionBackend.get_supported_kernel_block_sizes() (tests/serving check it against the installed vLLM).
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
    pp = option_value(vllm_args, ("--pipeline-parallel-size", "-pp"))
    if pp is not None and pp.strip() != "1":
        raise UsageError(f"--pipeline-parallel-size {pp}: the fusedkv vLLM plugin runs pipeline parallel size 1 "
                         "(vLLM's CPU build runs no pipeline stages); use --tensor-parallel-size")
    tp = option_value(vllm_args, ("--tensor-parallel-size", "-tp"))
    if tp is not None and tp.strip() != "1":
        check_tensor_parallel(config, tp)
    cache_dtype = option_value(vllm_args, ("--kv-cache-dtype",))
    if cache_dtype not in (None, "auto", "float32", "bfloat16", "float16") and getattr(config, "kv_lora_rank", None):
        raise UsageError(f"--kv-cache-dtype {cache_dtype}: the plugin's latent-attention (MLA) layers keep their "
                         "latents unquantised; serve with the default (auto)")


def check_tensor_parallel(config, value: str) -> None:
    """What the plugin's tensor parallel takes (`vllm_model.rank_heads`, `check_parallel`): heads that split evenly
    (KV heads replicated where fewer than ranks), multi-head attention and dense MLPs."""
    try:
        tp = int(value)
    except ValueError:
        raise UsageError(f"--tensor-parallel-size {value!r}: expected a whole number") from None
    if tp < 1:
        raise UsageError(f"--tensor-parallel-size {tp}: expected 1 or more")
    try:
        rank_heads(config.num_attention_heads, config.num_key_value_heads, tp, 0)
    except ValueError as e:
        raise UsageError(f"--tensor-parallel-size {tp}: {e}") from None
    if getattr(config, "kv_lora_rank", None) is not None or getattr(config, "num_experts", 0):
        raise UsageError(f"--tensor-parallel-size {tp}: the fusedkv plugin's tensor parallel runs multi-head attention "
                         "models with dense MLPs; serve MLA and mixture-of-experts models with size 1")


def reads_other_layers(config) -> bool:
    """Some reconstruction layer reads more than one layer's plain K and V (Lite, FusedKV, dense, custom)."""
    return any(not layer.stores and not (layer.k_sources == layer.v_sources and len(layer.k_sources) == 1
                                         and not layer.weighted)
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


def check_cpu_backend(config, block_size: int | None, python: str, env: dict, dtype: str = "float32",
                      kv_cache_dtype: str | None = None) -> None:
    """What vLLM's CPU attention runs here, asked of the installed vLLM (`cpu_probe`, in its environment): it
    accepts other shapes at start-up and fails at the first request."""
    if block_size is not None and block_size % CPU_BLOCK_MULTIPLE:
        raise UsageError(f"--block-size {block_size}: vLLM's CPU backend needs a multiple of {CPU_BLOCK_MULTIPLE}")
    if getattr(config, "kv_lora_rank", None) is not None:  # MLA: vllm_mla's own head size and cache
        return
    cache = kv_cache_dtype if kv_cache_dtype not in (None, "auto", dtype) else "auto"
    args = dict(head_dim=config.head_dim, num_heads=config.num_attention_heads,
                num_kv_heads=config.num_key_value_heads, dtype=dtype, kv_cache_dtype=cache,
                block_size=block_size or 128)
    try:
        out = subprocess.run([python, "-m", "fusedkv.serving.cpu_probe", json.dumps(args)], capture_output=True,
                             text=True, timeout=300, env=env, check=True).stdout
        reason = json.loads(out.strip().splitlines()[-1])["error"]
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, KeyError) as e:
        raise UsageError(f"cannot ask the vLLM environment's Python {python} what its CPU attention runs ({e}); "
                         "reinstall it with scripts/install-vllm.sh") from e
    if reason is None:
        return
    if cache != "auto":
        raise UsageError(f"--kv-cache-dtype {cache}: vLLM's CPU attention does not run it for head_dim="
                         f"{config.head_dim} on this processor ({reason}); serve with the default (auto)")
    raise UsageError(f"head_dim={config.head_dim}: vLLM's CPU attention does not run this head size on this processor "
                     f"({reason}; it would fail at the first request); serve this model with `fusedkv generate`, or "
                     "train one with another head_dim")


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
