"""The command line's conventions, as users of git, pip and hf expect them: ``--version``, ``-h`` as well as
``--help`` on every command, and positional arguments named for what they are (``SRC``, ``OUT``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer

import moeconvert
from moeconvert.cli import main
from moeconvert.cli.app import app, name_arguments

REPO = Path(__file__).resolve().parents[1]


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    captured = capsys.readouterr()
    return exc.value.code, captured.out, captured.err


def commands() -> list[list[str]]:
    """Every command's words: [], ["repack"], ["bench", "load"], ..."""
    found = []

    def walk(command, words):
        found.append(words)
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, words + [name])

    walk(typer.main.get_command(app), [])
    return found


def test_version_prints_the_distributions_version():
    declared = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert moeconvert.__version__ == declared
    done = subprocess.run([sys.executable, "-m", "moeconvert", "--version"], capture_output=True, text=True)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"moeconvert {declared}\n", "")


def test_every_command_is_covered():
    words = {" ".join(c) for c in commands()}
    assert {"", "inspect", "repack", "quantize", "verify", "example", "bench", "bench load"} <= words


@pytest.mark.parametrize("words", commands(), ids=lambda w: " ".join(w) or "moeconvert")
def test_short_help_is_the_same_help(words, capsys):
    code, long_help, err = run(words + ["--help"], capsys)
    assert (code, err) == (0, "") and long_help.startswith("Usage: moeconvert")
    code, short_help, err = run(words + ["-h"], capsys)
    assert (code, err) == (0, "")
    assert short_help == long_help
    assert "-h, --help" in long_help  # and the help says so


@pytest.mark.parametrize("words", [w for w in commands() if w and w != ["bench"]], ids=" ".join)
def test_arguments_are_named_src_and_out(words, capsys):
    _, text, _ = run(words + ["--help"], capsys)
    usage = text.splitlines()[0]
    assert "out_dir" not in text and not re.search(r"\{src\}", usage)
    # each positional argument in the usage line is in capitals, and is SRC or OUT where it is one of those
    shown = re.findall(r"[{\[]([A-Za-z_]+)[}\]]", usage.split("[OPTIONS]", 1)[1])
    assert all(name.isupper() for name in shown), usage
    if words[-1] in ("repack", "quantize", "vllm-startup", "vllm-serve"):
        assert shown == ["SRC", "OUT"], usage
    if words[-1] in ("verify", "example", "load", "layer"):
        assert shown == ["OUT"], usage


def test_a_missing_argument_is_named_as_in_the_help(capsys):
    code, out, err = run(["repack", "some-src"], capsys)
    assert code == 2 and out == ""
    assert err == "moeconvert: error: repack: missing argument 'OUT' (see moeconvert repack --help)\n"


def test_name_arguments_keeps_an_explicit_metavar():
    command = typer.main.get_command(app)
    argument = next(p for p in command.commands["repack"].params if p.name == "src")
    argument.metavar = "CHECKPOINT"
    name_arguments(command)
    assert argument.metavar == "CHECKPOINT"
