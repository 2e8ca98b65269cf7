"""One error policy for every `fusedkv` subcommand.

Library code raises ordinary exceptions with messages a user can act on:

  * `ValueError` (or its subclass `UsageError`) and `FileNotFoundError`: the input is wrong (a config
    field, a flag, a path, a checkpoint). The CLI prints one line and exits with `EXIT_USAGE` (2).
  * `RunError`: the input was fine but the job failed while running (a diverged loss, a full disk, a
    non-finite result). The CLI prints one line and exits with `EXIT_FAILURE` (1).
  * `OSError` from the operating system (disk full, permission denied): reported as a `RunError` naming
    the file, exit 1.
  * anything else is a bug: one line saying so and how to see the traceback, exit 1.

`--debug` (or `FUSEDKV_DEBUG=1`) re-raises instead, so the full traceback is shown.

`run_command` applies this policy around one command's handler; `fusedkv.cli.main` and the stand-alone
entry points (`python -m fusedkv.train.command`) both go through it, so every command reports alike.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import sys

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


class UsageError(ValueError):
    """Bad input the user can fix (exit 2)."""

    exit_code = EXIT_USAGE


class RunError(RuntimeError):
    """A failure while running on valid input (exit 1)."""

    exit_code = EXIT_FAILURE


class Stopped(RunError):
    """Work stopped by a signal after saving what resumes it (exit 143 for SIGTERM, 130 otherwise)."""

    def __init__(self, message: str, signal_name: str | None):
        super().__init__(message)
        self.exit_code = EXIT_TERMINATED if signal_name == "SIGTERM" else EXIT_INTERRUPTED


def debug_enabled(argv_flag: bool = False) -> bool:
    return argv_flag or os.environ.get("FUSEDKV_DEBUG", "") not in ("", "0", "false", "no")


def check_device(device: str | None, flag: str = "--device") -> None:
    """Refuse a device this build or machine cannot use, before any work starts (torch would fail later
    with an AssertionError deep inside model loading)."""
    if device in (None, "", "auto", "cpu"):
        return
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise UsageError(f"{flag} {device} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA support" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise UsageError(f"{flag} {device}: {why}; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"{flag} {device}: only {torch.cuda.device_count()} CUDA device(s) are visible "
                             f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
    elif dev.type != "cpu":
        raise UsageError(f"{flag} {device}: fusedkv runs on cpu or cuda, not {dev.type}")


@contextlib.contextmanager
def writing(path):
    """Name `path` in an OSError raised while writing it: a failed write() (a full disk) carries no file
    name of its own, and the user must learn which file could not be written."""
    try:
        yield
    except OSError as e:
        if not e.filename:
            e.filename = str(path)
        raise


def describe_os_error(e: OSError) -> str:
    """A one-line description of an OS-level failure that names the file and the likely fix."""
    where = f" {e.filename!r}" if getattr(e, "filename", None) else ""
    if e.errno == errno.ENOSPC:
        return f"no space left on the device while writing{where}; free some disk space and retry"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied on{where or ' a file'}; choose a directory you can write to"
    if e.errno == errno.EISDIR:
        return f"{where.strip() or 'a path'} is a directory; give a file"
    if e.errno == errno.ENOTDIR:
        return f"{where.strip() or 'a path'} is not a directory"
    return f"{e.strerror or e}{' (' + where.strip() + ')' if where else ''}"


def exit_code_and_message(e: BaseException) -> tuple[int, str]:
    """How the CLI reports an exception: (exit code, one-line message)."""
    if isinstance(e, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted"
    if isinstance(e, (UsageError, RunError)):
        return e.exit_code, str(e)
    if isinstance(e, FileNotFoundError):
        return EXIT_USAGE, str(e) if not e.filename else f"no such file or directory: {e.filename!r}"
    if isinstance(e, (IsADirectoryError, NotADirectoryError, PermissionError)):
        return EXIT_USAGE, describe_os_error(e)
    if isinstance(e, OSError):
        return EXIT_FAILURE, describe_os_error(e)
    if isinstance(e, ValueError):
        return EXIT_USAGE, str(e)
    if "No space left on device" in str(e) or "StorageFull" in str(e):
        # safetensors (and some C++ writers) report ENOSPC as their own exception type, without the file.
        return EXIT_FAILURE, "no space left on the device while writing a file; free some disk space and retry"
    if isinstance(e, RuntimeError) and "enforce fail at inline_container" in str(e):
        # torch.save's zip writer reports a full disk this way.
        return EXIT_FAILURE, "could not finish writing a checkpoint file (is the disk full?); free space and retry"
    return EXIT_FAILURE, (f"internal error: {type(e).__name__}: {e} (this is a bug in fusedkv; rerun with --debug "
                          "or FUSEDKV_DEBUG=1 for the traceback and report it)")


def report(command: str, e: BaseException) -> int:
    code, message = exit_code_and_message(e)
    message = re.sub(r"\s*\n\s*", " ", message.strip())  # one line, even for a library's multi-line message
    prefix = f"fusedkv {command}" if command else "fusedkv"
    print(f"{prefix}: {message if code == EXIT_INTERRUPTED else 'error: ' + message}", file=sys.stderr)
    return code


def run_command(command: str, handler, args, debug: bool = False) -> int:
    """Run `handler(args)` under the error policy: its int result (or 0) is the exit code; an exception
    becomes one line on stderr and its exit code, or propagates with its traceback under --debug."""
    try:
        check_device(getattr(args, "device", None))
        result = handler(args)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - the policy decides; KeyboardInterrupt included
        if debug_enabled(debug):
            raise
        return report(command, e)
    return result if isinstance(result, int) else EXIT_OK
