"""The Typer app every verb module registers its commands on (``moeconvert.cli`` runs it)."""

from __future__ import annotations

from typing import Optional

import typer

from moeconvert import __version__

# `-h` as well as `--help`, on every command: click hands a context's settings down to its subcommands
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Convert Mixture-of-Experts checkpoints once, offline, into backend-ready safetensors.")

#: how help and usage errors name a positional argument, by its parameter name in the verb modules:
#: what it is (a source checkpoint, an output folder), as git, pip and hf name theirs, not the Python name
ARGUMENT_NAMES = {"src": "SRC", "out_dir": "OUT"}


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"moeconvert {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Optional[bool] = typer.Option(None, "--version", is_eager=True, expose_value=False,
                                           callback=_print_version, help="Print moeconvert's version and exit."),
) -> None:
    pass


def name_arguments(command) -> None:
    """Give every positional argument of ``command`` and its subcommands the name :data:`ARGUMENT_NAMES`
    has for it (its metavar), for help and for the one-line usage errors."""
    for param in getattr(command, "params", []):
        if param.param_type_name == "argument" and param.metavar is None and param.name in ARGUMENT_NAMES:
            param.metavar = ARGUMENT_NAMES[param.name]
    for sub in getattr(command, "commands", {}).values():
        name_arguments(sub)
