"""`fusedkv serve`: vLLM's OpenAI-compatible server on 127.0.0.1 with the plugin, end to end.

One server for the module (a FusedKV checkpoint, eager mode, the default dtype, a vLLM flag passed after
`--` behind fusedkv's own options). Its outputs must be the transformers model's (the default dtype is
the checkpoint's float32), concurrent requests must return what sequential ones do, chat completions
must work on a checkpoint saved without a chat template, and SIGTERM must stop every process it
started. Further servers: one of a checkpoint `fusedkv train` saved (chat completions with the template it
carries; then its supervisor is killed with SIGKILL: nothing of vLLM survives), one whose logits overflow
(HTTP 500, then `fusedkv serve` exits 1 naming the cause), one of a Lite checkpoint with `--skip-prefill`
(the tokens of the full model; prompt log-probabilities refused), one interrupted during start-up (exit 130, no
traceback). Bad checkpoints must fail before vLLM starts, with `fusedkv
generate`'s messages. Request loops are bounded by time.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests import _cli as cli_process
from tests.serving.conftest import REPO, vllm_env

STARTUP_TIMEOUT_S = 900  # first start on a busy 2-core machine includes vLLM's model inspection; servers start together
API_KEY = "fusedkv-test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fusedkv_cli(*args: str) -> cli_process.Result:
    return cli_process.fusedkv(*args, cwd=REPO, env=vllm_env(), timeout=120)  # test_serve_preflight's zygote


def post(port: int, path: str, body: dict, key: str | None = API_KEY) -> dict:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def vllm_group(proc: subprocess.Popen) -> int | None:
    """The process group of the vLLM server `fusedkv serve` started (its API server's pid), or None."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    for line in out.splitlines():
        pid, ppid, args = line.split(None, 2)
        if int(ppid) == proc.pid and "vllm.entrypoints" in args:
            return int(pid)
    return None


def group_pids(pgid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,pgid=,stat="], capture_output=True, text=True).stdout
    return [int(pid) for pid, group, stat in (line.split() for line in out.splitlines())
            if int(group) == pgid and not stat.startswith("Z")]


def wait_until(predicate, timeout: float, step: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


class ServerLog:
    """What `fusedkv serve` printed: its stdout (vLLM's log lines), then its stderr (fusedkv serve's own lines,
    its last line last)."""

    def __init__(self, out: Path, err: Path):
        self.out, self.err = Path(out), Path(err)

    def read_text(self) -> str:
        return "".join(f.read_text(errors="replace") if f.exists() else "" for f in (self.out, self.err))


def copy_lines(src, path: Path) -> None:
    with open(path, "w") as f:
        for line in iter(src.readline, ""):
            f.write(line)
            f.flush()


def start_server(vllm_python: str, model, log, *extra: str, wait: bool = True) -> dict:
    """`fusedkv serve` as a child of the CLI tests' zygote (tests/_cli.py: no interpreter start-up and torch
    import per server; a session of its own), vLLM run by it as a user's run would be."""
    port = free_port()
    args = ["serve", str(model), "--port", str(port), "--enforce-eager", "--block-size", "32", "--kv-cache-memory",
            "64M", "--max-num-seqs", "32", "--vllm-python", vllm_python, *extra]
    proc = cli_process.start_module("fusedkv.cli", *args, env=vllm_env(), cwd=REPO)
    out, err = Path(f"{log}.out"), Path(f"{log}.err")
    if isinstance(proc, subprocess.Popen):  # a fresh interpreter (FUSEDKV_TEST_FRESH=1): its pipes to the files
        for src, dst in ((proc.stdout, out), (proc.stderr, err)):
            threading.Thread(target=copy_lines, args=(src, dst), daemon=True).start()
    else:
        out, err = proc.out, proc.err
    server = {"proc": proc, "port": port, "model": str(model), "log": ServerLog(out, err)}
    return wait_ready(server) if wait else server


def wait_ready(server) -> dict:
    port, proc, log = server["port"], server["proc"], server["log"]
    wait_until(lambda: healthy(port) or proc.poll() is not None, STARTUP_TIMEOUT_S, 0.5)
    if not healthy(port):
        stop(server)
        pytest.fail(f"the server did not come up (exit {proc.poll()}):\n{log.read_text()[-6000:]}")
    return server


def stop(server) -> None:
    """Leave nothing behind, whatever a failed test did."""
    proc = server["proc"]
    group = vllm_group(proc)
    if proc.poll() is None:
        proc.kill()  # its watchdog then stops vLLM's group; so does the line below
    if group is not None and group_pids(group):
        os.killpg(group, signal.SIGKILL)


def train_nano(root) -> Path:
    """A checkpoint `fusedkv train` saves: two steps of the nano preset (head_dim 32, which vLLM's CPU attention
    runs)."""
    out = root / "run"
    env = {**vllm_env(), "FUSEDKV_DATA_DIR": str(root / "data")}
    trained = cli_process.fusedkv("train", "--preset", "nano", "--max-steps", "2", "--set", "model.head_dim=32",
                                  "--set", "threads=1", "--out", str(out), "--quiet", cwd=REPO, env=env, timeout=600)
    assert trained.returncode == 0, trained.stderr[-3000:]
    return out / "final"


@pytest.fixture(scope="module")
def launched(request, vllm_python, checkpoints, tmp_path_factory):
    """The module's long-lived servers, started without waiting and together, so that their start-ups (and the
    training of the trained checkpoint) overlap on a multi-core machine; each only if a selected test uses it:
    `server` (the FusedKV checkpoint), `overflowing` (logits that overflow), `trained` (`fusedkv train`'s)."""
    wanted = {name for item in request.session.items if item.module is request.module for name in item.fixturenames}
    root = tmp_path_factory.mktemp("servers")
    servers = {}
    try:
        if "server" in wanted:
            # vLLM's --api-key after `--`, behind fusedkv's own options: pass-through in any argument order.
            servers["server"] = start_server(vllm_python, checkpoints["fusedkv"], root / "server.log", "--",
                                             "--api-key", API_KEY, wait=False)
        if "overflowing" in wanted:
            servers["overflowing"] = start_server(vllm_python, overflowing_checkpoint(checkpoints, root),
                                                  root / "overflowing.log", wait=False)
        if "trained" in wanted:
            servers["trained"] = start_server(vllm_python, train_nano(root), root / "trained.log", wait=False)
        if "skipping" in wanted:
            servers["skipping"] = start_server(vllm_python, checkpoints["fusedkv-lite"], root / "skipping.log",
                                               "--skip-prefill", wait=False)
        yield servers
    finally:
        for s in servers.values():
            stop(s)


@pytest.fixture(scope="module")
def server(launched):
    return wait_ready(launched["server"])


@pytest.fixture(scope="module")
def trained(launched):
    """Served with fusedkv serve's defaults: the chat test asks it, then the kill -9 test kills its supervisor."""
    return wait_ready(launched["trained"])


@pytest.fixture(scope="module")
def skipping(launched):
    """A Lite checkpoint served with `--skip-prefill` (the paper's prefill, Sec. 3.3)."""
    return wait_ready(launched["skipping"])


@pytest.fixture(scope="module")
def overflowing(launched):
    return wait_ready(launched["overflowing"])


def complete(server, prompt_ids: list[int], max_tokens: int = 16) -> list[int]:
    body = {"model": server["model"], "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True}
    return post(server["port"], "/v1/completions", body)["choices"][0]["token_ids"]


@pytest.mark.slow
def test_serves_on_localhost_with_the_passed_through_api_key(server):
    request = urllib.request.Request(f"http://127.0.0.1:{server['port']}/v1/models",
                                     headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=30) as r:
        models = json.loads(r.read())
    assert [m["id"] for m in models["data"]] == [server["model"]]
    with pytest.raises(urllib.error.HTTPError) as e:  # vLLM got `-- --api-key`: no key, no answer
        urllib.request.urlopen(f"http://127.0.0.1:{server['port']}/v1/models", timeout=30)
    assert e.value.code == 401
    assert "on http://127.0.0.1:" in server["log"].read_text()  # bound to the loopback address by default


@pytest.mark.slow
def test_startup_and_ready_lines_state_dtype_plan_blocks_and_concurrency(server):
    # The supervisor writes its ready line once the server answers and its /metrics are read: it may
    # follow the fixture's first answered request by a moment on a busy machine, so wait for it (bounded).
    deadline = time.monotonic() + 60
    while True:
        log = server["log"].read_text()
        ready = [line for line in log.splitlines() if line.startswith("fusedkv serve: ready on ")]
        if ready or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert "plan fusedkv (2/4 layers hold KV cache), dtype float32" in log  # auto: the checkpoint's dtype
    assert len(ready) == 1, log[-3000:]
    # 64 MiB over 2 storage layers x 4 KV heads x 32 dims x (K, V) x 4 bytes = 32,768 tokens in 1,024 blocks.
    assert "1,024 KV blocks of 32 tokens (32,768 tokens), max concurrency 64.0 requests of 512 tokens" in ready[0]
    assert "no chat template" in log  # the checkpoint has none: the default is announced


@pytest.mark.slow
def test_text_completion_matches_transformers_by_default(server, references):
    for row in references["fusedkv"]["rows"]:
        body = {"model": server["model"], "prompt": row["prompt"], "max_tokens": 24, "temperature": 0,
                "return_token_ids": True, "ignore_eos": True}
        choice = post(server["port"], "/v1/completions", body)["choices"][0]
        assert choice["prompt_token_ids"] == row["prompt_ids"]  # vLLM tokenises with the checkpoint's tokenizer
        assert choice["token_ids"] == row["tokens"]


@pytest.mark.slow
def test_sixteen_concurrent_requests_equal_sequential_ones(server, references):
    base = [row["prompt_ids"] for row in references["fusedkv"]["rows"]]
    prompts = [base[i % len(base)][: len(base[i % len(base)]) - i // len(base)] for i in range(16)]  # 16 distinct
    assert len({tuple(p) for p in prompts}) == 16
    sequential = [complete(server, p) for p in prompts]
    with ThreadPoolExecutor(16) as pool:
        concurrent = list(pool.map(lambda p: complete(server, p), prompts))
    assert concurrent == sequential
    for row in references["fusedkv"]["rows"]:  # the untruncated prompts: the transformers model's tokens
        assert sequential[prompts.index(row["prompt_ids"])] == row["tokens"][:16]


@pytest.mark.slow
def test_skip_prefill_generates_transformers_tokens_and_refuses_prompt_logprobs(skipping, references):
    """The upper half runs only on sampled positions: the same greedy tokens as the full model, stated at
    start-up; prompt log-probabilities (which the skipped positions would get wrong) are refused by vLLM."""
    log = skipping["log"].read_text()
    assert "plan fusedkv-lite (2/4 layers hold KV cache), prefill skips layers 3-4" in log, log[-3000:]
    for row in references["fusedkv-lite"]["rows"]:
        assert complete(skipping, row["prompt_ids"], 24) == row["tokens"][:24]
    body = {"model": skipping["model"], "prompt": "In the", "max_tokens": 2, "prompt_logprobs": 1}
    with pytest.raises(urllib.error.HTTPError) as e:
        post(skipping["port"], "/v1/completions", body)
    assert e.value.code == 400
    assert "prompt" in json.loads(e.value.read())["error"]["message"]


def greedy_continuation(path, prompt_ids: list[int], n: int, pad_token_id: int) -> list[int]:
    """The transformers model's `n` greedy tokens after `prompt_ids`."""
    import torch

    from fusedkv import FusedKVForCausalLM

    model = FusedKVForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=pad_token_id)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.slow
def test_chat_completions_on_a_checkpoint_without_a_template(server, checkpoints):
    from transformers import AutoTokenizer

    from fusedkv.data.tokenizer import DEFAULT_CHAT_TEMPLATE

    messages = [{"role": "system", "content": "Speak as Juliet."}, {"role": "user", "content": "Who is there?"}]
    body = {"model": server["model"], "messages": messages, "max_tokens": 12, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True}
    reply = post(server["port"], "/v1/chat/completions", body)
    path = checkpoints["fusedkv"]
    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template(messages, chat_template=DEFAULT_CHAT_TEMPLATE, tokenize=False,
                                   add_generation_prompt=True)
    assert text == "System: Speak as Juliet.\n\nUser: Who is there?\n\nAssistant:"
    assert reply["prompt_token_ids"] == tok(text, add_special_tokens=False).input_ids
    expected = greedy_continuation(path, reply["prompt_token_ids"], 12, tok.pad_token_id)
    choice = reply["choices"][0]
    assert choice["token_ids"] == expected
    # The text is the tokens' (vLLM holds back a trailing incomplete UTF-8 sequence of byte-level BPE).
    content = choice["message"]["content"]
    assert content and tok.decode(expected, skip_special_tokens=True).startswith(content)


@pytest.mark.slow
def test_chat_completions_on_a_trained_checkpoint_use_the_template_it_carries(trained):
    """`fusedkv train` saves a chat template with its tokenizer: a trained checkpoint serves chat completions
    without `--chat-template` and without fusedkv serve's fallback."""
    from transformers import AutoTokenizer

    from fusedkv.data.tokenizer import DEFAULT_CHAT_TEMPLATE

    path = Path(trained["model"])
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE
    messages = [{"role": "user", "content": "Who is there?"}]
    body = {"model": trained["model"], "messages": messages, "max_tokens": 8, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True}
    reply = post(trained["port"], "/v1/chat/completions", body, key=None)
    assert "no chat template" not in trained["log"].read_text()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)  # the saved template
    assert reply["prompt_token_ids"] == tok(text, add_special_tokens=False).input_ids
    assert reply["choices"][0]["token_ids"] == greedy_continuation(path, reply["prompt_token_ids"], 8,
                                                                   tok.pad_token_id)


@pytest.mark.slow
def test_kill_9_of_fusedkv_serve_leaves_no_vllm_process(trained):
    """Runs after the chat test, on its server (pytest keeps file order)."""
    group = vllm_group(trained["proc"])
    assert group is not None and group_pids(group)
    trained["proc"].kill()  # SIGKILL: no handler of fusedkv's runs
    trained["proc"].wait(timeout=30)
    assert wait_until(lambda: not group_pids(group), 60), "vLLM outlived fusedkv serve"
    assert not healthy(trained["port"])


@pytest.mark.slow
def test_sigterm_stops_the_server_and_its_processes(server):
    """Runs last among the module server's tests (pytest keeps file order)."""
    proc = server["proc"]
    group = vllm_group(proc)
    assert group is not None and len(group_pids(group)) >= 2  # the API server, its engine core
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    assert wait_until(lambda: not group_pids(group), 30), "processes of the server outlived it"
    assert not healthy(server["port"])


def overflowing_checkpoint(checkpoints, root):
    """Finite weights whose logits overflow float32: the final norm's gain at the largest float."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = root / "overflow"
    shutil.copytree(checkpoints["fusedkv"], path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"].fill_(3e38)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.mark.slow
def test_non_finite_logits_answer_500_and_the_server_exits_1_naming_them(overflowing):
    s = overflowing
    with pytest.raises(urllib.error.HTTPError) as e:
        post(s["port"], "/v1/completions", {"model": s["model"], "prompt": "In the", "max_tokens": 4}, key=None)
    assert e.value.code == 500
    assert json.loads(e.value.read())["error"]["message"]
    assert s["proc"].wait(timeout=120) == 1
    last = s["log"].read_text().strip().splitlines()[-1]
    assert last.startswith("fusedkv serve: error: the vLLM server stopped by itself"), last
    assert "non-finite logits" in last


@pytest.mark.slow
def test_ctrl_c_during_startup_exits_130_without_a_traceback(vllm_python, checkpoints, tmp_path):
    s = start_server(vllm_python, checkpoints["fusedkv"], tmp_path / "server.log", wait=False)

    def vllm_output_began() -> bool:
        return any(line.strip() and not line.startswith("fusedkv serve: ")
                   for line in s["log"].read_text().splitlines())

    try:
        # Interrupt once vLLM is loading (its own output has begun), long before it is ready.
        assert wait_until(lambda: vllm_group(s["proc"]) is not None and vllm_output_began(), 120, 0.1)
        group = vllm_group(s["proc"])
        assert group is not None and not healthy(s["port"])
        s["proc"].send_signal(signal.SIGINT)
        assert s["proc"].wait(timeout=120) == 130
        log = s["log"].read_text()
        assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]
        assert wait_until(lambda: not group_pids(group), 30)
    finally:
        stop(s)


# ---- start-up errors: one line, exit 2, no vLLM started --------------------------------------------
def test_missing_checkpoint_fails_at_startup(tmp_path):
    r = fusedkv_cli("serve", str(tmp_path / "nope"))
    assert r.returncode == 2
    assert r.stderr.strip() == f"fusedkv serve: error: checkpoint directory {str(tmp_path / 'nope')!r} does not exist"


@pytest.mark.slow
def test_truncated_weights_fail_like_generate(checkpoints, tmp_path):
    import shutil

    bad = tmp_path / "truncated"
    shutil.copytree(checkpoints["fusedkv"], bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    served, generated = fusedkv_cli("serve", str(bad)), fusedkv_cli("generate", str(bad))
    assert served.returncode == generated.returncode == 2
    message = served.stderr.strip().splitlines()[-1].removeprefix("fusedkv serve: error: ")
    assert "truncated" in message
    assert message == generated.stderr.strip().splitlines()[-1].removeprefix("fusedkv generate: error: ")


def test_checkpoint_without_tokenizer_is_refused(checkpoints, tmp_path):
    import shutil

    bad = tmp_path / "no-tokenizer"
    shutil.copytree(checkpoints["fusedkv"], bad, ignore=shutil.ignore_patterns("tokenizer*"))
    r = fusedkv_cli("serve", str(bad))
    assert r.returncode == 2 and "has no tokenizer" in r.stderr


def test_missing_vllm_environment_says_how_to_install(checkpoints, tmp_path):
    r = fusedkv_cli("serve", str(checkpoints["fusedkv"]), "--vllm-python", str(tmp_path / "python"))
    assert r.returncode == 2 and "scripts/install-vllm.sh" in r.stderr
    r = fusedkv_cli("serve", str(checkpoints["fusedkv"]), "--vllm-python", sys.executable)  # no vLLM here
    assert r.returncode == 2 and "vLLM is not installed" in r.stderr and "scripts/install-vllm.sh" in r.stderr
