"""The docs point only at what is there, and the README's command synopsis is the command line's.

* Every relative link in README.md and docs/ (a markdown link, a ``*.md`` page named in the text, a path
  into this repository's own folders) names a file or folder of the repository.
* The synopsis in README.md's "Commands" section against each command's ``--help``: every verb and option
  in it exists, every command and every option of it appears, and the values listed for an option whose
  help lists its values (``--backend a|b|c``) are the help's. docs/quantize.md's shorter synopsis only
  names what exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer

from moeconvert.cli import main
from moeconvert.cli.app import app

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
# folders of this repository a doc may name a path in (``moeconvert/layouts/marlin.py``, ``scripts/setup.sh``)
OWN_FOLDERS = ("moeconvert", "runtime", "kernels", "tests", "scripts", "docs", ".ci")

MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MD_NAME = re.compile(r"(?<![\w/.-])((?:\.\.?/)*[\w./-]*\w\.md)\b")
OWN_PATH = re.compile(r"(?<![\w/.-])((?:%s)/[\w./<>-]*[\w/>])" % "|".join(re.escape(f) for f in OWN_FOLDERS))
PARENT_PATH = re.compile(r"(?<![\w/.-])((?:\.\./)+[\w./-]*\w)")


def inside(path: Path) -> bool:
    return path.resolve().is_relative_to(REPO.resolve())


def broken_references(doc: Path, text: str | None = None) -> list[str]:
    """What ``doc`` (or ``text``, read as if it were at ``doc``) names that is not in the repository, as
    ``doc:line: target``, each once."""
    problems = []
    for n, line in enumerate((doc.read_text() if text is None else text).splitlines(), 1):
        where = f"{doc.relative_to(REPO)}:{n}"
        for target in MD_LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL, or a heading of the same page
            path = doc.parent / target.split("#")[0]
            if not (inside(path) and path.exists()):
                problems.append(f"{where}: link to {target}")
        text = MD_LINK.sub(" ", line)  # a link's own text is not a second reference
        for name in MD_NAME.findall(text):
            # a page named in prose: next to the naming page, or from the repository's root
            if not any(inside(p) and p.is_file() for p in (doc.parent / name, REPO / name)):
                problems.append(f"{where}: names {name}")
        for name in OWN_PATH.findall(text) + PARENT_PATH.findall(text):
            if re.search(r"[<*{]", name):
                continue  # a pattern (tests/test_layout_<name>.py), not a file
            path = (doc.parent if name.startswith("..") else REPO) / name
            if not (inside(path) and path.exists()):
                problems.append(f"{where}: names {name}")
    return list(dict.fromkeys(problems))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_reference_is_in_the_repository(doc):
    assert broken_references(doc) == []


def test_the_reference_check_finds_what_is_missing():
    text = ("See [the format](format.md), `wna16-layouts.md` §3, DESIGN.md, ../shared/specs/x.md,\n"
            "`moeconvert/layouts/nonesuch.py`, [gone](layouts/gone.md), [ok](https://example.org),\n"
            "`docs/format.md`, `marlin.md`, `moeconvert/layouts/marlin.py` and `tests/test_layout_<name>.py`.\n")
    # read as if it were docs/page.md: format.md is its neighbour; marlin.md is docs/layouts/', not docs/'
    found = broken_references(REPO / "docs" / "page.md", text)
    assert found == ["docs/page.md:1: names wna16-layouts.md", "docs/page.md:1: names DESIGN.md",
                     "docs/page.md:1: names ../shared/specs/x.md",
                     "docs/page.md:2: link to layouts/gone.md", "docs/page.md:2: names moeconvert/layouts/nonesuch.py",
                     "docs/page.md:3: names marlin.md"]


# ---------------------------------------------------------------------------------------------------
# the synopsis against --help


def help_text(words: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(words + ["--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def commands() -> dict[tuple[str, ...], object]:
    """Every command of the CLI by its words: (), ("repack",), ("bench", "load"), ..."""
    found = {}

    def walk(command, words):
        found[words] = command
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, words + (name,))

    walk(typer.main.get_command(app), ())
    return found


def help_options(text: str) -> dict[frozenset[str], str]:
    """The options an ``--help`` lists, each as the set of its spellings (``-b, --backend``, ``--estimate /
    --no-estimate``), with its help text."""
    options: dict[frozenset[str], str] = {}
    current = None
    for line in text.split("\nOptions:\n", 1)[1].splitlines():
        m = re.match(r"  ((?:-[\w-]+(?: <[^>]*>)?(?:, | / )?)+)(.*)", line)
        if m:
            current = frozenset(re.findall(r"(?<![\w<])-[\w-]+", m.group(1)))
            options[current] = m.group(2).strip()
        elif current is not None and line.strip():
            options[current] += " " + line.strip()
    return options


def listed_values(option_help: str) -> set[str] | None:
    """``emulation | flashinfer-cutlass | marlin ...`` in an option's help, as a set; None if it lists none."""
    parts = re.sub(r"\([^()]*\)", " ", option_help).split(" | ")  # (remarks) after a value are not values
    if len(parts) < 2:
        return None
    # a value ends the first part and begins the last; a middle part may hold two lists' ends
    # ("kimi-k3; with --random-weights: qwen3-30b-a3b")
    words = [parts[0].split()[-1]] + [p.split()[0] for p in parts[1:]] + [p.split()[-1] for p in parts[1:-1]]
    return {w.strip(".,;:()`") for w in words}


def synopsis(block: str, known: dict) -> list[tuple[tuple[str, ...], set[str], dict[str, set[str]]]]:
    """(command words, options, {option: listed values}) for each entry of a synopsis block."""
    entries: list[list[str]] = []
    for line in block.splitlines():
        if line.startswith("moeconvert"):
            entries.append([line])
        elif line.strip() and entries:
            entries[-1].append(line)
    out = []
    for lines in entries:
        text = re.sub(r"\([^()]*\)", " ", " ".join(lines))  # (remarks) are not part of the grammar
        tokens = text.split()[1:]
        words: tuple[str, ...] = ()
        while tokens and words + (tokens[0],) in known:
            words += (tokens.pop(0),)
        if tokens and re.fullmatch(r"[a-z][\w|-]*", tokens[0]):  # a verb, not SRC / OUT / an option
            words += (tokens.pop(0),)
        rest = " ".join(tokens)
        options = set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", rest))
        values = {o: set(v.split("|")) for o, v in re.findall(r"(--[\w-]+)[ =]([\w.:-]+(?:\|[\w.:-]+)+)", rest)}
        out.append((words, options, values))
    return out


def blocks_after(path: Path, heading: str) -> str:
    text = path.read_text()
    return re.search(r"```\n(.*?)```", text[text.index(heading):], re.S).group(1)


def synopsis_problems(block: str, capsys, *, complete: bool) -> list[str]:
    known = commands()
    problems = []
    seen: dict[tuple[str, ...], set[str]] = {}
    for words, options, values in synopsis(block, known):
        name = " ".join(("moeconvert",) + words)
        if words not in known:
            problems.append(f"{name}: not a command")
            continue
        have = help_options(help_text(list(words), capsys))
        seen.setdefault(words, set()).update(options)
        problems += [f"{name} {o}: not in its --help" for o in sorted(options - set().union(*have))]
        for option, shown in values.items():
            listed = listed_values(next((h for spellings, h in have.items() if option in spellings), ""))
            if listed is None:
                continue
            problems += [f"{name} {option} {v}: its --help lists {' | '.join(sorted(listed))}"
                         for v in sorted(shown - listed)]
            if complete and option == "--backend" and listed - shown:
                problems.append(f"{name} --backend: the synopsis leaves out {sorted(listed - shown)}")
    if complete:
        for words, command in known.items():
            name = " ".join(("moeconvert",) + words)
            if hasattr(command, "commands") and words:
                continue  # a group (bench): its commands are the entries
            if words not in seen:
                problems.append(f"{name}: not in the synopsis")
                continue
            shown = seen[words] | seen.get((), set())  # `moeconvert -h | --help` is said once, for all
            missing = [max(s, key=len) for s in help_options(help_text(list(words), capsys)) if not s & shown]
            problems += [f"{name} {o}: in its --help, not in the synopsis" for o in sorted(missing)]
    return problems


def test_the_readme_synopsis_is_the_command_line(capsys):
    assert synopsis_problems(blocks_after(REPO / "README.md", "## Commands"), capsys, complete=True) == []


def test_the_quantize_page_names_only_what_exists(capsys):
    assert synopsis_problems(blocks_after(REPO / "docs" / "quantize.md", "# "), capsys, complete=False) == []


def test_the_synopsis_check_finds_stale_entries(capsys):
    stale = ("moeconvert repack SRC OUT --backend marlin|flashinfer-cutlass|nonesuch [--chunk-mb 256] [--gone]\n"
             "moeconvert bench make-folder OUT [--gb 6]\n"
             "moeconvert frobnicate SRC [--json]\n")
    problems = synopsis_problems(stale, capsys, complete=True)
    assert "moeconvert repack --gone: not in its --help" in problems
    assert any(p.startswith("moeconvert repack --backend nonesuch: its --help lists ") for p in problems)
    assert any(p.startswith("moeconvert repack --backend: the synopsis leaves out") for p in problems)
    assert "moeconvert repack --resume: in its --help, not in the synopsis" in problems
    assert "moeconvert bench make-folder --experts: in its --help, not in the synopsis" in problems
    assert "moeconvert verify: not in the synopsis" in problems
    assert "moeconvert frobnicate: not a command" in problems
