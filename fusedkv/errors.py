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
"""

from __future__ import annotations

import errno
import os
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


def debug_enabled(argv_flag: bool = False) -> bool:
    return argv_flag or os.environ.get("FUSEDKV_DEBUG", "") not in ("", "0", "false", "no")


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
    if isinstance(e, RuntimeError) and "enforce fail at inline_container" in str(e):
        # torch.save's zip writer reports a full disk this way.
        return EXIT_FAILURE, "could not finish writing a checkpoint file (is the disk full?); free space and retry"
    return EXIT_FAILURE, (f"internal error: {type(e).__name__}: {e} (this is a bug in fusedkv; rerun with --debug "
                          "or FUSEDKV_DEBUG=1 for the traceback and report it)")


def report(command: str, e: BaseException) -> int:
    code, message = exit_code_and_message(e)
    print(f"fusedkv {command}: error: {message}", file=sys.stderr)
    return code
