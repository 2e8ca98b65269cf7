"""`fusedkv chat` and `fusedkv generate --chat` as a user runs them: messages from a pipe (a scripted
conversation) and from a pseudo-terminal (the prompt, Ctrl-C at the prompt, `/reset`, Ctrl-D ends with exit 0).

The command runs in this process (the pipe) or in a fork of it (the terminal): starting an interpreter that
imports torch costs seconds per case on a small machine. The answers are checked against
`fusedkv.chat.ChatSession`'s, which tests/chat/test_chat_session.py checks against transformers' generate."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

from fusedkv.cli import main
from tests.chat.test_chat_session import session

ARGS = ["--greedy", "--max-new-tokens", "6", "--system", "Be brief."]


def answers(ckpt, *messages):
    s = session(ckpt)
    return [s.reply(m).text for m in messages]


def test_a_piped_conversation_with_reset_and_end_of_input(chat_ckpt, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\nand the fox?\n\n/reset\nhello there\n"))
    assert main(["chat", str(chat_ckpt), *ARGS, "--stats"]) == 0  # end of input: exit 0
    out, err = capsys.readouterr()
    first, second = answers(chat_ckpt, "hello there", "and the fox?")
    assert out.splitlines() == [first, second, first]  # after /reset the same message gets the same answer
    assert "[history cleared]" in err and "greedy" in next(line for line in err.splitlines() if "fusedkv chat:" in line)
    reused = [int(n) for n in re.findall(r"(\d+) from the cache", err)]
    assert reused[0] == 0 and reused[1] > 0 and reused[2] == 0  # kept across turns, not across /reset


def test_generate_chat_answers_one_turn(chat_ckpt, capsys):
    assert main(["generate", str(chat_ckpt), "--chat", "hello there", *ARGS]) == 0
    out, _ = capsys.readouterr()
    assert out.splitlines()[0] == answers(chat_ckpt, "hello there")[0]  # the answer alone, not the prompt
    assert main(["generate", str(chat_ckpt), "--prompt", "x", "--chat", "y"]) == 2
    assert "not both" in capsys.readouterr().err


def test_a_checkpoint_without_a_chat_template_is_refused_in_one_line(chat_ckpt, tmp_path, capsys):
    plain = tmp_path / "plain"
    shutil.copytree(chat_ckpt, plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    for argv in (["chat", str(plain)], ["generate", str(plain), "--chat", "hi"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(f"fusedkv {argv[0]}: error: {plain} has no chat template") and "Traceback" not in err


def read_until(fd, pattern: str, buffer: bytearray, timeout: float = 120) -> str:
    """The terminal's output up to and including the next `pattern` (consumed from `buffer`, read into it)."""
    deadline = time.monotonic() + timeout
    while pattern.encode() not in buffer:
        left = deadline - time.monotonic()
        shown = buffer.decode(errors="replace")
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise AssertionError(f"no {pattern!r} within {timeout} s; the terminal showed:\n{shown}")
        try:
            buffer += os.read(fd, 4096)
        except OSError:  # the child closed the terminal
            raise AssertionError(f"the chat ended before {pattern!r}; the terminal showed:\n{shown}") from None
    end = buffer.index(pattern.encode()) + len(pattern)
    part = buffer[:end].decode(errors="replace")
    del buffer[:end]
    return part


def wait_reading(pid: int, timeout: float = 30) -> None:
    """Until process `pid` sleeps in the kernel (blocked reading its terminal, as at the prompt). Python checks
    for a signal before it enters read(); one that lands between the prompt and the read is seen only when the
    read returns, so a test that types Ctrl-C the instant the prompt shows must wait for the read."""
    deadline = time.monotonic() + timeout
    asleep = 0
    while asleep < 3 and time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # no /proc (not Linux): nothing to wait on
            return
        asleep = asleep + 1 if state == "S" else 0
        time.sleep(0.05)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork and a pseudo-terminal")
def test_an_interactive_chat_in_a_terminal(chat_ckpt):
    first = answers(chat_ckpt, "hello there")[0]
    pid, fd = pty.fork()
    if pid == 0:  # the child: the terminal is its stdin, stdout and stderr (not pytest's capture)
        code = 99
        try:
            torch.set_num_threads(1)
            sys.stdin, sys.stdout, sys.stderr = (open(0, closefd=False), open(1, "w", closefd=False),
                                                 open(2, "w", closefd=False))
            code = main(["chat", str(chat_ckpt), *ARGS])
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    status = None
    try:
        seen = bytearray()
        banner = read_until(fd, ">>> ", seen)
        assert "fusedkv chat: plan fusedkv" in banner and "/reset clears the history" in banner
        os.write(fd, b"hello there\r")
        assert first in read_until(fd, ">>> ", seen)  # the answer, then a new prompt
        wait_reading(pid)  # a Ctrl-C typed before the child blocks in read() would wait for the next key
        os.write(fd, b"\x03")  # Ctrl-C at the prompt: a fresh prompt, not the end
        assert "Ctrl-D ends" in read_until(fd, ">>> ", seen)
        os.write(fd, b"/reset\r")
        assert "[history cleared]" in read_until(fd, ">>> ", seen)
        os.write(fd, b"hello there\r")
        assert first in read_until(fd, ">>> ", seen)  # the history is gone: the same answer as the first time
        os.write(fd, b"\x04")  # Ctrl-D
        deadline = time.monotonic() + 60
        while status is None and time.monotonic() < deadline:
            done, code = os.waitpid(pid, os.WNOHANG)
            status = os.waitstatus_to_exitcode(code) if done else None
            time.sleep(0.05)
        assert status == 0, f"exit status {status}"
    finally:
        if status is None:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        os.close(fd)
