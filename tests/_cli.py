"""`python -m MODULE ARGS` (the `fusedkv` CLI) in a child process, as a user runs it, without paying
Python's start-up for every case.

Starting an interpreter that imports torch and transformers costs seconds per process on a small machine
(tens of seconds on a busy one), and many tests run the command line. So a "zygote" process imports fusedkv
once and forks one child per case; the child runs the module as `__main__` (as `python -m` does) with the
case's argv, environment and working directory, its file descriptors 1 and 2 going to files. Exit codes,
stderr and tracebacks are the ones a user sees.

What a fresh interpreter reads only at start-up (OMP_NUM_THREADS, PYTHONWARNINGS, TRANSFORMERS_VERBOSITY,
PYTHONPATH, ...) cannot be changed in a forked child, so there is one zygote per such environment: a case
shares a zygote only with cases whose environment differs from it in FUSEDKV_* variables alone (fusedkv
reads those when it runs, not when it is imported) and in pytest's PYTEST_CURRENT_TEST. A zygote whose
imports printed anything (a warning) is not used: its children would not print it again, so those cases
start a fresh interpreter. FUSEDKV_TEST_FRESH=1 starts a fresh interpreter for every case (slower, same
assertions); tests/reliability/test_cli_policy.py checks that both agree.

`run_module` waits for the case to end; `start_module` leaves it running and returns a Popen-like Child (for
the tests that signal or kill a run); `run_script` runs `python SCRIPT ARGS`. The zygote has also built the
CLI's parser (importing every subcommand) and imported datasets and matplotlib, which runs import anyway.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_ZYGOTE = textwrap.dedent(r'''
    import json, os, runpy, signal, sys, time, traceback
    sys.path[0] = os.getcwd()  # the repository, absolute, as `python -m` run there puts it first
    import fusedkv, fusedkv.cli, fusedkv.data, fusedkv.eval.command  # the slow imports, paid once
    fusedkv.cli.build_parser()  # and every subcommand's module, which each run would import again
    import datasets, matplotlib.pyplot  # imported when run by data preparation and by every plot
    sys.stdout.write("ready\n"); sys.stdout.flush()
    def reap(pid, timeout):  # the exit code, "timeout" once `timeout` seconds have passed (None: wait on)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            if deadline is not None and time.monotonic() >= deadline:
                return "timeout"
            time.sleep(0.01)
    for line in sys.stdin:
        req = json.loads(line)
        op = req.get("op", "run")
        if op in ("poll", "wait"):  # a child started by "start"
            code = reap(req["pid"], 0 if op == "poll" else req["timeout"])
            sys.stdout.write(json.dumps({"rc": code}) + "\n"); sys.stdout.flush()
            continue
        pid = os.fork()
        if pid == 0:
            os.setsid()
            out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            err = os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(out, 1); os.dup2(err, 2)
            sys.stdin.close()
            os.environ.clear(); os.environ.update(req["env"]); os.chdir(req["cwd"])
            script = req.get("script")  # `python SCRIPT ARGS` rather than `python -m MODULE ARGS`
            sys.argv = [script or req["module"], *req["argv"]]
            # what a fresh interpreter would show
            sys.orig_argv = [sys.executable, *([script] if script else ["-m", req["module"]]), *req["argv"]]
            try:
                if script:
                    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` puts it first
                    runpy.run_path(script, run_name="__main__")
                else:
                    sys.modules.pop(req["module"], None)  # run it as __main__, as `python -m` does
                    runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            except BaseException:
                sys.excepthook(*sys.exc_info())
                code = 1
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
        if op == "start":  # it runs on; the caller polls, waits for and signals it by pid
            sys.stdout.write(json.dumps({"pid": pid}) + "\n"); sys.stdout.flush()
            continue
        code = reap(pid, req["timeout"])
        if code == "timeout":
            os.killpg(pid, signal.SIGKILL); os.waitpid(pid, 0)
        sys.stdout.write(json.dumps({"rc": code}) + "\n"); sys.stdout.flush()
''')


@dataclass
class Result:
    """What subprocess.run(..., capture_output=True, text=True) returns, for the fields the tests read."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str

    def error_line(self) -> str:
        """The last non-empty stderr line (progress bars and warnings may come before it)."""
        lines = [ln for ln in self.stderr.splitlines() if ln.strip()]
        return lines[-1] if lines else ""


def _startup_key(env: dict) -> tuple:
    # FUSEDKV_* are read when fusedkv runs; pytest sets PYTEST_CURRENT_TEST for every test.
    return tuple(sorted((k, v) for k, v in env.items()
                        if not k.startswith(("FUSEDKV_", "PYTEST_")) and k not in ("PWD", "OLDPWD")))


class _Zygote:
    def __init__(self, env: dict, workdir: Path):
        self.err_path = workdir / f"zygote-{os.getpid()}-{id(self)}.err"
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE], cwd=REPO, env=env, text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the CLI zygote did not start:\n{self.err_path.read_text()[-3000:]}")
        self.clean = self.err_path.read_text().strip() == ""  # its imports printed nothing
        self.running: set[int] = set()  # children started by Runner.start and not yet reaped

    def ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self):
        if self.alive():
            self.proc.stdin.close()  # it leaves its loop and exits
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Runner:
    """`runner.run(module, args, env=..., cwd=..., timeout=...)` runs `python -m module ARGS` in a child
    process and returns a Result; at most `keep` zygotes (one per start-up environment) live at once."""

    def __init__(self, workdir: Path | None = None, keep: int = 2):  # ~0.5 GB each
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="fusedkv-cli-"))
        self.own_workdir = workdir is None
        self.keep = keep
        self.zygotes: dict[tuple, _Zygote] = {}
        self.count = 0

    def _zygote(self, env: dict) -> _Zygote:
        key = _startup_key(env)
        z = self.zygotes.pop(key, None)
        if z is None or not z.alive():
            z = _Zygote(env, self.workdir)
        self.zygotes[key] = z  # most recently used last
        idle = [k for k, other in self.zygotes.items() if k != key and not other.running]
        while len(self.zygotes) > self.keep and idle:  # never one whose started children still run
            self.zygotes.pop(idle.pop(0)).close()
        return z

    def _request(self, module: str, args, env: dict | None, cwd, timeout: float | None, op: str, script=None):
        argv = [str(a) for a in args]
        env = dict(os.environ if env is None else env)
        cwd = str(cwd or os.getcwd())
        if os.environ.get("FUSEDKV_TEST_FRESH") == "1" or not (z := self._zygote(env)).clean:
            return None, argv, env, cwd
        self.count += 1
        out, err = self.workdir / f"case{self.count}.out", self.workdir / f"case{self.count}.err"
        req = dict(op=op, module=module, script=script, argv=argv, env=env, cwd=cwd, out=str(out), err=str(err),
                   timeout=timeout)
        return (z, z.ask(req), out, err), argv, env, cwd

    def run(self, module: str | None, args, env: dict | None = None, cwd: Path | str | None = None,
            timeout: float = 300, script: str | None = None) -> Result:
        """... or `python SCRIPT ARGS` where `script` (a path) is given instead of a module."""
        forked, argv, env, cwd = self._request(module, args, env, cwd, timeout, "run", script)
        if forked is None:
            p = subprocess.run([sys.executable, *([script] if script else ["-m", module]), *argv],
                               capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
            return Result(argv, p.returncode, p.stdout, p.stderr)
        _, reply, out, err = forked
        rc = reply["rc"]
        if rc == "timeout":
            raise subprocess.TimeoutExpired([script or module, *argv], timeout)
        result = Result(argv, rc, out.read_text(errors="replace"), err.read_text(errors="replace"))
        out.unlink(), err.unlink()
        return result

    def start(self, module: str, args, env: dict | None = None, cwd: Path | str | None = None):
        """`python -m module ARGS` started in a child process and left running: a Child, or a
        subprocess.Popen (text, stdout and stderr piped) where a fresh interpreter is due."""
        forked, argv, env, cwd = self._request(module, args, env, cwd, None, "start")
        if forked is None:
            return subprocess.Popen([sys.executable, "-m", module, *argv], cwd=cwd, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        z, reply, out, err = forked
        z.running.add(reply["pid"])
        return Child(z, reply["pid"], [module, *argv], out, err)

    def close(self):
        for z in self.zygotes.values():
            z.close()
        self.zygotes.clear()
        if self.own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


class Child:
    """A running `python -m MODULE` forked by a zygote, with what the tests use of subprocess.Popen: pid,
    returncode, poll, wait, communicate (its stdout and stderr, as text), send_signal and kill."""

    def __init__(self, zygote: _Zygote, pid: int, args: list[str], out: Path, err: Path):
        self.zygote, self.pid, self.args, self.out, self.err = zygote, pid, args, out, err
        self.returncode: int | None = None

    def _reap(self, op: str, timeout: float | None) -> int | None:
        if self.returncode is None:
            rc = self.zygote.ask(dict(op=op, pid=self.pid, timeout=timeout))["rc"]
            if rc == "timeout":
                if op == "wait":
                    raise subprocess.TimeoutExpired(self.args, timeout)
            else:
                self.returncode = rc
                self.zygote.running.discard(self.pid)
        return self.returncode

    def poll(self) -> int | None:
        return self._reap("poll", 0)

    def wait(self, timeout: float | None = None) -> int:
        return self._reap("wait", timeout)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.out.read_text(errors="replace"), self.err.read_text(errors="replace")

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # not reaped: the pid is still this child's
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_shared: Runner | None = None


def run_module(module: str, *args, env: dict | None = None, cwd: Path | str | None = None,
               timeout: float = 300) -> Result:
    """`python -m module ARGS` as a child process of the session's shared runner (environment: the test's,
    unless `env` is given; working directory: the current one, unless `cwd` is)."""
    return _runner().run(module, args, env=env, cwd=cwd, timeout=timeout)


def _runner() -> Runner:
    global _shared
    if _shared is None:
        _shared = Runner()
        atexit.register(_shared.close)
    return _shared


def run_script(script: str | Path, *args, env: dict | None = None, cwd: Path | str | None = None,
               timeout: float = 300) -> Result:
    """`python SCRIPT ARGS` as a child process of the session's shared runner (as run_module)."""
    return _runner().run(None, args, env=env, cwd=cwd, timeout=timeout, script=str(script))


def start_module(module: str, *args, env: dict | None = None, cwd: Path | str | None = None):
    """`python -m module ARGS` started as a child process of the session's shared runner and left running:
    a Popen-like Child (poll, wait, communicate, send_signal, kill, pid, returncode)."""
    return _runner().start(module, args, env=env, cwd=cwd)


def fusedkv(*args, env: dict | None = None, cwd: Path | str | None = None, timeout: float = 300) -> Result:
    """`python -m fusedkv.cli ARGS`: the `fusedkv` command, as a child process."""
    return run_module("fusedkv.cli", *args, env=env, cwd=cwd, timeout=timeout)
