"""The library never depends on the reference job (``shardopt.recipes``) or the command.

Two checks: importing each library module in a fresh interpreter leaves ``shardopt.recipes`` out of
``sys.modules``, and no library source file mentions it in an import, also inside a function (where
an import only runs when called).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import shardopt

PACKAGE = Path(shardopt.__file__).parent
# The command and the job it runs: everything else is the library.
NOT_LIBRARY = ("shardopt.recipes", "shardopt.cli", "shardopt.__main__")


# The framework each adapter imports: an optional extra, absent from a plain install.
FRAMEWORKS = {"shardopt.integrations.lightning": "lightning",
              "shardopt.integrations.accelerate": "accelerate",
              "shardopt.integrations.transformers": "transformers"}


def _library_modules() -> list[str]:
    names = ["shardopt"]
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="shardopt."):
        framework = FRAMEWORKS.get(info.name)
        if framework is not None and importlib.util.find_spec(framework) is None:
            continue
        if not info.name.startswith(NOT_LIBRARY):
            names.append(info.name)
    return names


def test_the_library_covers_its_core_modules():
    names = set(_library_modules())
    for core in ("optimizer", "layout", "buffers", "comm", "kernels", "config", "checkpoint"):
        assert f"shardopt.{core}" in names
    assert not any(n.startswith("shardopt.recipes") for n in names)


_PROBE = """
import importlib, json, sys
for name in json.loads(sys.argv[1]):
    before = set(sys.modules)
    importlib.import_module(name)
    pulled = sorted(m for m in set(sys.modules) - before if m.startswith({not_library!r}))
    if pulled:
        print(json.dumps([name, pulled]))
        break
"""


def test_importing_the_library_does_not_import_recipes():
    # One fresh interpreter imports the modules one after another and reports the first that
    # pulls in the command or the recipes: imports only add to sys.modules, so this is what a
    # fresh interpreter per module would see, at a twentieth of the start-up cost.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(PACKAGE.parent)
    probe = _PROBE.format(not_library=NOT_LIBRARY)
    proc = subprocess.run([sys.executable, "-c", probe, json.dumps(_library_modules())],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"importing {proc.stdout.strip()}"


def _imported_names(tree: ast.AST, module: str) -> list[str]:
    package = module if module == "shardopt" or PACKAGE.joinpath(*module.split(".")[1:]).is_dir() \
        else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out += [base] + [f"{base}.{a.name}" for a in node.names]
    return out


def test_no_library_source_imports_recipes_even_lazily():
    offenders = []
    for name in _library_modules():
        parts = name.split(".")[1:]
        path = PACKAGE.joinpath(*parts, "__init__.py") if PACKAGE.joinpath(*parts).is_dir() \
            else PACKAGE.joinpath(*parts[:-1], parts[-1] + ".py")
        for imported in _imported_names(ast.parse(path.read_text()), name):
            if imported.startswith(NOT_LIBRARY):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}: {imported}")
    assert not offenders, offenders


def test_the_static_check_sees_relative_and_lazy_imports():
    # The check above can fail: a function-level relative import of the recipes is caught.
    tree = ast.parse("def f():\n    from ..recipes import train\n    from . import io\n")
    names = _imported_names(tree, "shardopt.checkpoint.export")
    assert "shardopt.recipes.train" in names and "shardopt.checkpoint.io" in names


def test_importing_shardopt_imports_no_framework():
    # The frameworks are optional: shardopt and shardopt.integrations import none of them,
    # each adapter module only its own.
    probe = ("import json, sys, shardopt, shardopt.checkpoint, shardopt.integrations; "
             "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & "
             f"{set(FRAMEWORKS.values())!r})))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(PACKAGE.parent)
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []
