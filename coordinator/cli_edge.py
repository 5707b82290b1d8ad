"""The edge of every ``twopc`` command: exit codes monitoring can act on, and one line for each
failure an operator can cause, never a traceback.

A command returns one of the `Exit` codes; anything it raises is turned into one line on stderr,
``twopc: [code] message``, with the code of ``docs/errors.md`` first (as `TransactionError`
prints it) so alerts can match on it, and an exit code chosen by who must act. ``twopc -v``
prints the traceback as well. An exception nobody expected is a bug: it says so, names
``internal-error`` and exits `Exit.INTERNAL`, distinct from everything an operator causes.

The table is ``docs/operations.md``'s "Exit codes"; change both together.
"""

from __future__ import annotations

import argparse
import enum
import errno
import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from .errors import HeuristicError, TransactionError, TransientError


class Exit(enum.IntEnum):
    """Exit codes. When several apply, a command returns the most urgent (lowest in this list
    after `OK`: a heuristic outranks a resource that is down, which outranks an old in-doubt)."""

    OK = 0  #: nothing to act on
    ATTENTION = 1  #: the command found something to look at (a log warning, ids not found)
    USAGE = 2  #: the command could not run: usage, configuration, a path or port (argparse too),
    #: or a refusal its code names (``log-locked``: the service holds the log)
    IN_DOUBT = 3  #: a transaction in doubt for longer than the threshold (``--older-than``)
    HEURISTIC = 4  #: a heuristic outcome is live: a human must reconcile, then ``twopc forget``
    UNREACHABLE = 5  #: a resource or server could not be reached; run again once it is back
    INTERNAL = 70  #: a bug (``internal-error``): report it with the ``-v`` traceback
    INTERRUPTED = 130  #: Ctrl-C
    PIPE_CLOSED = 141  #: the reader went away (``| head``); as a process killed by SIGPIPE


def most_urgent(*codes: Exit) -> Exit:
    """The code to return when several findings apply (see `Exit`)."""
    order = (Exit.HEURISTIC, Exit.UNREACHABLE, Exit.IN_DOUBT, Exit.ATTENTION)
    for code in order:
        if code in codes:
            return code
    return Exit.OK


def exit_code_of(exc: TransactionError) -> Exit:
    """Who must act on a `TransactionError`, as an exit code."""
    if isinstance(exc, HeuristicError):
        return Exit.HEURISTIC
    if isinstance(exc, TransientError):
        return Exit.UNREACHABLE
    return Exit.USAGE


def one_line(text: str) -> str:
    """Messages may quote a server's multi-line error; the contract is one line per failure."""
    return " ".join(text.split())


def say(message: str) -> None:
    print(f"twopc: {one_line(message)}", file=sys.stderr, flush=True)


def run_guarded(command: Callable[[], int], *, verbose: bool) -> int:
    """Run a parsed command; turn whatever it raises into one line and an exit code."""
    try:
        code = int(command())
        sys.stdout.flush()  # a closed pipe shows here, inside the guard, not at interpreter exit
        return code
    except BrokenPipeError:
        return pipe_closed()
    except KeyboardInterrupt:
        _trace(verbose)
        return interrupted()
    except TransactionError as exc:
        _trace(verbose)
        say(str(exc))
        return exit_code_of(exc)
    except OSError as exc:
        _trace(verbose)
        say(f"[os-error] {_describe_os_error(exc)}")
        return Exit.UNREACHABLE if isinstance(exc, ConnectionError | TimeoutError) else Exit.USAGE
    except Exception as exc:
        _trace(verbose)
        say(
            f"[internal-error] {type(exc).__name__}: {exc} (a bug in twopc or a plugin; run "
            "again as `twopc -v ...` for the traceback and report it)"
        )
        return Exit.INTERNAL


def _describe_os_error(exc: OSError) -> str:
    where = f" {exc.filename}" if exc.filename is not None else ""
    reason = exc.strerror or str(exc)
    hint = {
        errno.ENOENT: " (check the path)",
        errno.EACCES: " (check the permissions, and which user runs twopc)",
        errno.ENOTDIR: " (a file where a directory is expected)",
        errno.EADDRINUSE: " (another process listens there: stop it or choose another address)",
        errno.ENOSPC: " (free some space)",
    }.get(exc.errno or 0, "")
    return f"{reason}{':' if where else ''}{where}{hint}"


def interrupted() -> int:
    say("[interrupted] stopped by Ctrl-C; nothing is left half-done that recovery cannot finish")
    return Exit.INTERRUPTED


def pipe_closed() -> int:
    """The reader closed the pipe: stop quietly. stdout is pointed at /dev/null so the
    interpreter's final flush of what is still buffered does not fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is not a real file (a test's capture): nothing to do
        pass
    return Exit.PIPE_CLOSED


def _trace(verbose: bool) -> None:
    if verbose:
        traceback.print_exc()


class Parser(argparse.ArgumentParser):
    """argparse with the CLI's edge: a usage error is one line with its code, exit `Exit.USAGE`
    (subparsers inherit the class, plugins' too)."""

    def error(self, message: str) -> NoReturn:
        say(f"[usage] {message} (see `{self.prog} --help`)")
        raise SystemExit(Exit.USAGE)
