"""`fusedkv serve`: vLLM's OpenAI-compatible server on 127.0.0.1 with the plugin, end to end.

One server for the module (a FusedKV checkpoint, eager mode). Concurrent requests must return what
sequential ones do (and what the transformers model generates); SIGTERM must stop the server and
every process it started. Bad checkpoints must fail before vLLM starts, with `fusedkv generate`'s
messages.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import REPO, vllm_env

STARTUP_TIMEOUT_S = 600  # first start on a busy 2-core machine includes vLLM's model inspection


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fusedkv_cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fusedkv.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, **kwargs)


def post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def session_pids(pgid: int) -> list[int]:
    """Live processes of the process group the server was started in (its own session)."""
    out = subprocess.run(["ps", "-eo", "pid=,pgid=,stat="], capture_output=True, text=True).stdout
    return [int(pid) for pid, group, stat in (line.split() for line in out.splitlines())
            if int(group) == pgid and not stat.startswith("Z")]


@pytest.fixture(scope="module")
def server(vllm_python, checkpoints, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    model = str(checkpoints["fusedkv"])
    cmd = [sys.executable, "-m", "fusedkv.cli", "serve", model, "--port", str(port), "--enforce-eager",
           "--block-size", "32", "--kv-cache-memory", "64M", "--max-num-seqs", "32", "--dtype", "float32",
           "--vllm-python", vllm_python]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=vllm_env(), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    break
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the server did not come up (exit {proc.poll()}):\n{log.read_text()[-6000:]}")
        time.sleep(2)
    yield {"proc": proc, "port": port, "model": model, "log": log}
    if proc.poll() is None:  # a failed test left it running
        os.killpg(proc.pid, signal.SIGKILL)


def complete(server, prompt_ids: list[int], max_tokens: int = 16) -> list[int]:
    body = {"model": server["model"], "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True}
    return post(server["port"], "/v1/completions", body)["choices"][0]["token_ids"]


@pytest.mark.slow
def test_serves_on_localhost_and_lists_the_model(server):
    with urllib.request.urlopen(f"http://127.0.0.1:{server['port']}/v1/models", timeout=30) as r:
        models = json.loads(r.read())
    assert [m["id"] for m in models["data"]] == [server["model"]]
    assert "on http://127.0.0.1:" in server["log"].read_text()  # bound to the loopback address by default


@pytest.mark.slow
def test_text_completion_matches_transformers(server, references):
    row = references["fusedkv"]["rows"][1]
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
def test_sigterm_stops_the_server_and_its_processes(server):
    """Runs last in this module (pytest keeps file order)."""
    proc = server["proc"]
    assert len(session_pids(proc.pid)) >= 2  # fusedkv serve, the API server, its engine core
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    deadline = time.monotonic() + 30
    while session_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert session_pids(proc.pid) == [], "processes of the server outlived it"
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{server['port']}/health", timeout=5)


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
