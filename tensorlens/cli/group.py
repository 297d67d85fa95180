"""The ``tensorlens`` click group: lazy subcommands, ``--version``, and one place that turns
errors into a message and an exit code (see :mod:`tensorlens.cli` for the codes)."""

from __future__ import annotations

import importlib
import io
import os
import re
import sqlite3
import sys
from collections.abc import Sequence
from typing import Any

import click

from tensorlens.cli import COMMANDS
from tensorlens.cli.table import echo, printable

#: Errors a user can cause (a missing run, a bad regular expression, a damaged file): one line, no traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (
    FileNotFoundError, NotADirectoryError, PermissionError, KeyError, ValueError, re.error, sqlite3.DatabaseError,
    ImportError, OSError,
)


class PipeClosed(Exception):
    """The reader of standard output went away (``tensorlens show RUN | head``). Not an OSError,
    so that click does not turn it into its own exit code 1."""


class LazyGroup(click.Group):
    """Imports a subcommand's module only when that subcommand runs (or ``--help`` lists it)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, _, attribute = target.partition(":")
        command = getattr(importlib.import_module(module), attribute or "command")
        if not isinstance(command, click.Command):
            raise TypeError(f"{target} is not a click command")
        return command


def _version() -> str:
    from tensorlens._version import __version__

    return __version__


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(_version(), "--version", "-V", prog_name="tensorlens", message="%(prog)s %(version)s")
def cli() -> None:
    """Look at tensorlens runs: list them, print their statistics, export them, and build a
    self-contained HTML report or module explorer.

    RUN is a run folder (./tensorlens_runs/<run>, or a hook's run_dir).
    """


def run(argv: Sequence[str] | None = None) -> int:
    """Run the group with ``argv`` (default: ``sys.argv[1:]``) and return the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get("TENSORLENS_DEBUG", "") not in ("", "0")
    try:
        try:
            result = cli.main(args=args, prog_name="tensorlens", standalone_mode=False)
        finally:
            sys.stdout.flush()  # a closed pipe shows up here for buffered output
        return int(result) if isinstance(result, int) else 0
    except click.exceptions.Exit as done:
        return done.exit_code
    except click.ClickException as err:
        # click's own message (a usage error repeats what was typed) goes out through printable too
        shown = io.StringIO()
        err.show(file=shown)
        echo(shown.getvalue().rstrip("\n"), err=True)
        return err.exit_code
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        return 130
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        return 130
    except (BrokenPipeError, PipeClosed):
        _silence_stdout()
        return 141
    except SystemExit as done:  # click exits 1 on EPIPE it catches itself
        return done.code if isinstance(done.code, int) else 1
    except USER_ERRORS as err:
        if debug:
            raise
        _error(err)
        return 1


def _error(err: BaseException) -> None:
    message = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
    if isinstance(err, re.error):
        message = f"not a valid regular expression ({err})"
    echo(f"Error: {message or type(err).__name__}", err=True)


def _silence_stdout() -> None:
    # the reader went away: later writes (and the interpreter's final flush) must not raise again
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def echo_lines(lines: Any) -> None:
    """Print lines as they come, through :func:`~tensorlens.cli.table.printable` (names in them come
    from run stores); a closed pipe ends the command (exit 141) without a traceback."""
    try:
        for line in lines:
            click.echo(printable(line, newlines=True))
        sys.stdout.flush()
    except BrokenPipeError:
        raise PipeClosed from None
