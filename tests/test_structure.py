"""The package's structure, asserted by importing (docs/architecture.md): the runtime reads the
format, the layouts, the canonical block and the errors, never the converter; nothing but the CLI's
``bench`` verbs imports ``moeconvert.bench``."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from pathlib import Path

from helpers import cli  # tests/ is on sys.path under pytest

import moeconvert.runtime

#: what ``moeconvert.runtime`` may import of moeconvert: the format, the layouts and what they are made of
#: (the canonical block, schemes, int32 packing, MXFP4 codes), the errors, plugins (entry points), the
#: runtime's own modules and the kernels
RUNTIME_MAY_IMPORT = ("moeconvert", "moeconvert.format", "moeconvert.layouts", "moeconvert.canonical",
                      "moeconvert.schemes", "moeconvert.packing", "moeconvert.mxfp4", "moeconvert.errors",
                      "moeconvert.plugins", "moeconvert.runtime", "moeconvert.kernels")
#: the converter (and the tools around it), which the runtime never imports
CONVERTER = ("sources", "modelmap", "convert", "decode", "quantize", "writer", "verify", "bench", "cli", "example")


def allowed(module: str) -> bool:
    return any(module == a or (a != "moeconvert" and module.startswith(a + ".")) for a in RUNTIME_MAY_IMPORT)


def imported(code: str, *argv: str) -> list[str]:
    """The moeconvert modules a fresh interpreter has imported after running ``code``."""
    code += "\nimport sys, json; print(json.dumps(sorted(m for m in sys.modules if m.startswith('moeconvert'))))"
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True)
    return json.loads(r.stdout.splitlines()[-1])


def test_loading_an_output_imports_no_converter_module(example_ckpt, tmp_path):
    src = example_ckpt("qwen3-moe", "w4a16", group_size=32, num_experts=4)
    out = tmp_path / "marlin"
    cli("repack", src, out, "--backend", "marlin", expect=0)
    mods = imported("import sys, warnings\nwarnings.simplefilter('ignore')\nimport moeconvert.runtime\n"
                    "model = moeconvert.runtime.load(sys.argv[1], verify=True)\nassert model.moe_layers", str(out))
    assert "moeconvert.runtime.model" in mods and "moeconvert.format.manifest" in mods
    assert [m for m in mods if not allowed(m)] == []
    assert [m for m in mods if m.split(".")[1:2] and m.split(".")[1] in CONVERTER] == []


def test_runtime_sources_import_only_what_it_may():
    """Lazy imports too (inside functions), which importing alone does not run."""
    for path in sorted(Path(moeconvert.runtime.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for name in names:
                if name.startswith("moeconvert"):
                    assert allowed(name), f"{path.name}:{node.lineno} imports {name}"


def test_the_converter_never_imports_the_bench():
    mods = imported("import moeconvert.cli, moeconvert.convert, moeconvert.verify, moeconvert.example, "
                    "moeconvert.runtime")
    assert "moeconvert.convert" in mods
    assert [m for m in mods if m == "moeconvert.bench" or m.startswith("moeconvert.bench.")] == []


def test_the_plan_is_beneath_jobs_and_the_writer():
    """Data flows one way: plan <- jobs <- convert, plan <- writer; the lower module never imports a higher one
    (lazy imports inside functions included)."""
    import moeconvert

    root = Path(moeconvert.__file__).parent
    never = {"plan": {"jobs", "writer", "convert", "executors", "cli"},
             "writer": {"jobs", "convert", "executors", "cli"},
             "jobs": {"convert", "executors", "cli"}}
    for module, higher in never.items():
        tree = ast.parse((root / f"{module}.py").read_text())
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for name in names:
                parts = name.split(".")
                assert not (parts[0] == "moeconvert" and len(parts) > 1 and parts[1] in higher), \
                    f"{module}.py:{node.lineno} imports {name}"


def test_the_format_is_the_bottom_layer():
    """format/ imports nothing of moeconvert but its own modules and the error type (lazy imports inside
    functions included), and importing it loads nothing else of ours: the layouts and the schemes read the
    format, never the other way round."""
    import moeconvert.format

    for path in sorted(Path(moeconvert.format.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for name in names:
                if name.startswith("moeconvert"):
                    assert name == "moeconvert.errors" or name.startswith("moeconvert.format"), \
                        f"format/{path.name}:{node.lineno} imports {name}"
    mods = imported("import moeconvert.format")
    assert "moeconvert.format.manifest" in mods
    assert [m for m in mods if m not in ("moeconvert", "moeconvert.errors") and not m.startswith("moeconvert.format")] == []


def test_the_wheel_lists_every_package_of_the_source_tree():
    """A regular (not editable) install holds only the packages pyproject.toml lists: a package missing
    there imports in the repository and fails at a user's (``pip install 'moeconvert[vllm]'``), e.g.
    ``No module named 'moeconvert.readers'`` when vLLM loads the plugin."""
    root = Path(__file__).resolve().parents[1]
    tools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {name: root / path for name, path in tools["package-dir"].items()}

    def where(package: str) -> Path:  # the folder setuptools takes a package from
        parent = max((n for n in dirs if package == n or package.startswith(n + ".")), key=len)
        return dirs[parent].joinpath(*package[len(parent):].strip(".").split(".")) if package != parent else dirs[parent]

    listed = set(tools["packages"])
    assert all((where(p) / "__init__.py").is_file() for p in listed), listed
    found = set()
    for top, folder in dirs.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder).parts
            found.add(".".join((top, *rel)) if rel else top)
    assert found <= listed, sorted(found - listed)
