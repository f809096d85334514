"""The ``moeconvert`` command line: ``moeconvert <verb> ...``, one grammar, the same options everywhere.

User errors (bad input, and bad options too: Typer's usage errors are reworded here) end with one line
on stderr and exit code 2 (``--debug`` anywhere on the line shows the traceback too); a bug in moeconvert
itself exits 1. SIGINT and SIGTERM unwind the run like an error, so its staging folder is removed, then
say so in one line and exit 130 / 143.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import threading
import traceback

import typer
import typer.core

from moeconvert.cli.app import app, name_arguments
from moeconvert.errors import MoeConvertError


class Interrupted(BaseException):
    """SIGINT or SIGTERM, raised in the main thread wherever the run is.

    A BaseException, as KeyboardInterrupt is, so no ``except Exception`` on the way swallows it, and every
    ``finally`` / ``__exit__`` runs (the writer's removes its staging folder). Not a KeyboardInterrupt:
    Typer turns that into a silent exit 130 before we could say what happened.
    """

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _signals_unwind():
    """While the command runs, the first SIGINT / SIGTERM raises :class:`Interrupted`; a second one,
    while the first is still unwinding, exits at once (what is left is cleared by the next run)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def handler(signum, frame):
        if caught:
            os.write(2, f"moeconvert: interrupted twice ({signal.Signals(signum).name}); stopped at once, "
                        "the next run on the same output removes what was left\n".encode())
            os._exit(128 + signum)
        caught.append(signum)
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _click_errors(command) -> tuple[tuple, tuple, tuple]:
    """(usage errors, exits, aborts) of the click that ``command`` is built on.

    Typer may run on the installed click or on its own copy (``typer._click``), whose exceptions are
    other classes: take them from the modules the command's classes come from, plus ``click``'s if
    something imported it.
    """
    names = {"click.exceptions", "typer.exceptions"}
    for c in type(command).__mro__:
        names |= {c.__module__, c.__module__.rpartition(".")[0] + ".exceptions"}
    modules = [sys.modules.get(n) for n in names]

    def found(name):
        return tuple({getattr(m, name) for m in modules if isinstance(getattr(m, name, None), type)})

    return found("ClickException"), found("Exit") + (typer.Exit,), found("Abort")


def _given(argv: list[str], opts: list[str]) -> str | None:
    """The value last given on the command line for an option spelled one of ``opts``."""
    value = None
    for i, a in enumerate(argv):
        for o in opts:
            if a == o and i + 1 < len(argv):
                value = argv[i + 1]
            elif o.startswith("--") and a.startswith(o + "="):
                value = a[len(o) + 1:]
    return value


def _command_path(command, argv: list[str]) -> str:
    """``moeconvert bench load``: the verbs ``argv`` starts with (for an error click gave no context)."""
    words = ["moeconvert"]
    for a in argv:
        command = getattr(command, "commands", {}).get(a)
        if command is None:
            break
        words.append(a)
    return " ".join(words)


def _usage_line(e, argv: list[str], command) -> str:
    """One line for a click usage error: which verb, what is wrong, what was given, where help is."""
    ctx = getattr(e, "ctx", None)
    path = ctx.command_path if ctx is not None else _command_path(command, argv)
    verb = path.partition(" ")[2]
    possibilities = getattr(e, "possibilities", None)
    text = (e.message if possibilities else e.format_message()).strip().rstrip(".")
    text = text[:1].lower() + text[1:]
    notes = []
    if possibilities:
        notes.append("did you mean " + " or ".join(sorted(possibilities)))
    param = getattr(e, "param", None)
    if type(e).__name__ != "MissingParameter" and param is not None and getattr(param, "opts", None):
        value = _given(argv, [o for o in param.opts if o.startswith("-")])
        if value is not None:
            notes.append(f"found {value!r}")
    if ctx is not None and text.startswith("no such command") and hasattr(ctx.command, "list_commands"):
        notes.append("expected one of: " + ", ".join(ctx.command.list_commands(ctx)))
    notes.append(f"see {path} --help")
    line = f"{verb}: {text}" if verb else text
    return " ".join(f"{line} ({'; '.join(notes)})".split())


#: errors of the machine or of the paths given, never of moeconvert: a user error wherever they surface
_USER_ERRNOS = {errno.ENAMETOOLONG, errno.ELOOP, errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES,
                errno.EPERM, errno.EIO}


def main(argv: list[str] | None = None) -> None:
    try:
        _main(argv)
    except BrokenPipeError:
        # whoever read our output stopped reading (`| head`): nothing went wrong, and nothing more can be
        # said there; point stdout at /dev/null so the interpreter's last flush does not complain either
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        sys.exit(141)  # as if killed by SIGPIPE, what a shell reports for the same


def _main(argv: list[str] | None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or bool(os.environ.get("MOECONVERT_DEBUG"))
    argv = [a for a in argv if a != "--debug"]
    command = typer.main.get_command(app)
    name_arguments(command)
    usage_errors, exits, aborts = _click_errors(command)
    try:
        with _signals_unwind():
            code = command.main(args=argv, prog_name="moeconvert", standalone_mode=False)
    except MoeConvertError as e:
        if debug:
            traceback.print_exc()
        print(f"moeconvert: error: {e.line()}", file=sys.stderr)
        sys.exit(2)
    except Interrupted as e:
        if debug:
            traceback.print_exc()
        print(f"moeconvert: interrupted ({signal.Signals(e.signum).name}); no unfinished output was left behind",
              file=sys.stderr)
        sys.exit(128 + e.signum)
    except exits as e:
        sys.exit(e.exit_code)
    except usage_errors as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # a bare `moeconvert` or `moeconvert bench`: the help
            print(e.format_message())
            sys.exit(0)
        if debug:
            traceback.print_exc()
        print(f"moeconvert: error: {_usage_line(e, argv, command)}", file=sys.stderr)
        sys.exit(2)
    except aborts + (KeyboardInterrupt,):
        print("moeconvert: interrupted; no unfinished output was left behind", file=sys.stderr)
        sys.exit(130)
    except (OSError, RuntimeError) as e:
        if isinstance(e, BrokenPipeError):
            raise
        if debug:
            traceback.print_exc()
        line = _os_error_line(e)
        if line is None:
            _internal_error(e)
        print(f"moeconvert: error: {line}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:  # a bug: say so, keep the one-line promise unless asked for more
        if debug:
            traceback.print_exc()
        _internal_error(e)
    sys.exit(code if isinstance(code, int) else 0)


def _os_error_line(e: BaseException) -> str | None:
    """The one line for an OS error that is the machine's or the given paths' fault, else None."""
    if isinstance(e, RuntimeError) and str(e).startswith("Symlink loop from "):
        return f"{str(e)[len('Symlink loop from '):].strip(chr(39))}: a symbolic link loop"  # pathlib < 3.13
    if isinstance(e, OSError) and e.errno in _USER_ERRNOS:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    return None


def _internal_error(e: BaseException) -> None:
    line = " ".join(f"{type(e).__name__}: {e}".split())
    print(f"moeconvert: internal error: {line} (rerun with --debug for the traceback)", file=sys.stderr)
    sys.exit(1)


# The verb modules register their commands on `app` when imported; this order is the order of --help.
from moeconvert.cli import inspect, convert, verify, example, bench  # noqa: E402,F401
