"""The Typer app every verb module registers its commands on (``moeconvert.cli`` runs it)."""

from __future__ import annotations

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Convert Mixture-of-Experts checkpoints once, offline, into backend-ready safetensors.")
