"""`fusedkv serve`'s hold on the vLLM server process: nothing survives it, nothing dies silently.

  * vLLM runs in a process group of its own (a new session: the terminal's Ctrl-C reaches only
    fusedkv, which stops vLLM in order). Its API server gets a parent-death signal (prctl
    PR_SET_PDEATHSIG) and a small watchdog process holds a pipe from this one: when `fusedkv serve` dies,
    even by `kill -9`, the pipe closes and the watchdog stops the whole group (SIGTERM, then SIGKILL).
  * vLLM's output is copied through and its last lines kept, so that when the server stops by itself
    (an engine that died: vLLM's API server then exits, sometimes with status 0) `fusedkv serve` exits 1
    with the error line that says why.
  * Once /health answers, one line states what is served: plan, dtype, KV blocks and the concurrency
    they hold (from vLLM's own /metrics `vllm:cache_config_info` and /v1/models).
  * SIGINT / SIGTERM: vLLM gets SIGTERM (a second signal: SIGKILL), its group is emptied, and the exit
    status is 130 for an interrupt, 0 for a requested stop (SIGTERM). vLLM's output after the request
    (shutdown noise, a KeyboardInterrupt traceback during start-up) is not shown.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from ..errors import EXIT_INTERRUPTED, EXIT_OK, RunError

STOP_GRACE_S = 20  # SIGTERM to SIGKILL

# Runs as `python -c WATCHDOG FD PGID GRACE_S`: reads the pipe until the supervisor writes "done" or dies (EOF).
WATCHDOG = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
fd, pgid = int(sys.argv[1]), int(sys.argv[2])
while True:
    chunk = os.read(fd, 16)
    if not chunk or chunk == b"done":
        break
def alive():
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
if chunk != b"done" and alive():
    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + float(sys.argv[3])
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    if alive():
        os.killpg(pgid, signal.SIGKILL)
"""

_PREFIX = re.compile(r"^\((?:APIServer|EngineCore\w*|Worker\w*)[^)]*\)\s*")
_LOG_HEADER = re.compile(r"^(?:ERROR|WARNING|INFO|CRITICAL)\s+\S+\s+\S+\s+\[[^\]]*\]\s*")
_EXCEPTION = re.compile(r"^[\w.]*(?:Error|Exception)(?::\s|$)")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the watchdog alone


class Server:
    def __init__(self, cmd: list[str], env: dict, poll_url: str, describe, api_key: str | None = None):
        """`describe(metrics_text, models_json)` -> the ready line (or None to say nothing); `api_key`: the
        server's (vLLM's --api-key), sent with the requests that read its state."""
        self.cmd, self.env, self.poll_url, self.describe = cmd, env, poll_url, describe
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.tail: collections.deque[str] = collections.deque(maxlen=400)
        self.stop_signal: int | None = None
        self.proc: subprocess.Popen | None = None

    # ---- output -------------------------------------------------------------------------------
    def _copy(self, src, dst) -> None:
        for line in iter(src.readline, ""):
            self.tail.append(line.rstrip("\n"))
            if self.stop_signal is None:
                dst.write(line)
                dst.flush()
        src.close()

    def reason(self) -> str:
        """The root cause among vLLM's last lines: the first exception line that is not one of the wrappers
        that only point back at it ("EngineDeadError: ... see stack trace above"); else its last line (an
        argument error, say)."""
        found = []
        for line in self.tail:
            text = _LOG_HEADER.sub("", _PREFIX.sub("", line.strip()))
            if _EXCEPTION.match(text) and not re.search(r"stack trace|EngineDeadError", text):
                found.append(text)
        if found:
            return found[0]
        last = [_LOG_HEADER.sub("", _PREFIX.sub("", line.strip())) for line in self.tail if line.strip()]
        return last[-1] if last else "it printed nothing"

    # ---- signals ------------------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        if self.stop_signal is not None or self.proc is None:  # a second signal: no more waiting
            self._kill_group(signal.SIGKILL)
            self.stop_signal = self.stop_signal or signum
            return
        self.stop_signal = signum
        print(f"fusedkv serve: stopping the server ({signal.Signals(signum).name})", file=sys.stderr, flush=True)
        try:
            self.proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass

    def _kill_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def _empty_group(self) -> None:
        """Stop whatever of the group outlived the API server (engine core, workers)."""
        if not self._group_alive():
            return
        self._kill_group(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while self._group_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        self._kill_group(signal.SIGKILL)

    # ---- readiness --------------------------------------------------------------------------------
    def _get(self, path: str) -> str | None:
        try:
            request = urllib.request.Request(self.poll_url + path, headers=self.headers)
            with urllib.request.urlopen(request, timeout=5) as r:
                return r.read().decode() if r.status == 200 else None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return None

    def _announce(self) -> None:
        metrics, models = self._get("/metrics"), self._get("/v1/models")
        try:
            line = self.describe(metrics or "", json.loads(models) if models else {})
        except (ValueError, KeyError, TypeError) as e:  # the numbers are a courtesy: never fail the server
            line = f"fusedkv serve: ready on {self.poll_url}/v1 (could not read its cache figures: {e})"
        if line:
            print(line, file=sys.stderr, flush=True)

    # ---- the run ------------------------------------------------------------------------------------
    def run(self) -> int:
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        read_fd, write_fd = os.pipe()
        watchdog, ready = None, False
        try:
            try:
                self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                             text=True, errors="replace", bufsize=1, start_new_session=True,
                                             preexec_fn=_die_with_parent)
            except OSError as e:
                raise RunError(f"could not start the vLLM server with {self.cmd[0]}: {e}") from e
            watchdog = subprocess.Popen([sys.executable, "-c", WATCHDOG, str(read_fd), str(self.proc.pid),
                                         str(STOP_GRACE_S)], pass_fds=(read_fd,), start_new_session=True)
            copiers = [threading.Thread(target=self._copy, args=(src, dst), daemon=True)
                       for src, dst in ((self.proc.stdout, sys.stdout), (self.proc.stderr, sys.stderr))]
            for t in copiers:
                t.start()
            if self.stop_signal is not None:  # signalled while starting it
                self.proc.send_signal(signal.SIGTERM)
            stop_since = None
            while self.proc.poll() is None:
                if not ready and self.stop_signal is None and self._get("/health") is not None:
                    ready = True
                    self._announce()
                try:
                    self.proc.wait(timeout=1 if ready else 0.5)
                except subprocess.TimeoutExpired:
                    if self.stop_signal is not None:  # asked to stop: SIGKILL after the grace period
                        stop_since = stop_since or time.monotonic()
                        if time.monotonic() - stop_since > STOP_GRACE_S:
                            self._kill_group(signal.SIGKILL)
            code = self.proc.returncode
            self._empty_group()
            for t in copiers:
                t.join(timeout=5)
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
            if self.proc is not None:  # whatever happened here, nothing of the server outlives this
                self._empty_group()
            os.close(read_fd)
            try:
                os.write(write_fd, b"done")  # the group is empty: the watchdog has nothing to do
            except OSError:
                pass
            os.close(write_fd)
            if watchdog is not None:
                watchdog.wait(timeout=10)
        if self.stop_signal == signal.SIGINT:
            return EXIT_INTERRUPTED
        if self.stop_signal is not None:
            return EXIT_OK
        raise RunError(f"the vLLM server stopped by itself (exit status {code}"
                       f"{', after it was ready' if ready else ', during start-up'}): {self.reason()}")
