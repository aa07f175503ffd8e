"""One direction of dependency: the package's imports form no cycle and none runs upward.

Layers, lowest first: the core (every module not named below), ``shardopt.checkpoint``, the
package's own ``__init__`` (the names it exports), and what uses the library from outside: the
reference job and the framework adapters (``shardopt.recipes``, ``shardopt.recipes.integrations``)
and the command (``shardopt.cli``, ``shardopt.__main__``). A module imports from its own layer or below. The check
walks every import statement with ``ast``, also inside functions and under ``TYPE_CHECKING``
(where an import runs only when called, or never, yet still says what depends on what).
Besides, importing each library module in a fresh interpreter leaves ``shardopt.recipes`` out of
``sys.modules``.
"""

from __future__ import annotations

import ast
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


# The frameworks the adapters import: optional extras, absent from a plain install.
FRAMEWORKS = ("lightning", "accelerate", "transformers")


def _library_modules() -> list[str]:
    names = ["shardopt"]
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="shardopt."):
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


# Layers by module prefix, lowest first; a module's layer is that of its longest prefix.
LAYERS = {"shardopt.": 0, "shardopt.checkpoint": 1, "shardopt": 2, "shardopt.recipes": 3,
          "shardopt.cli": 3, "shardopt.__main__": 3}


def _layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p if p.endswith(".")
                                                                      else p + ".")), key=len)
    return LAYERS[best]


def _all_modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports. ``from X import a, b`` imports ``X.a`` where
    that is a module, else ``X`` itself; a package's ``__init__`` importing its own
    submodules (to export their names) is not an edge."""
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in _import_targets(ast.parse(path.read_text()), name):
            if imported in modules and imported != name and not (
                    path.name == "__init__.py" and imported.startswith(name + ".")):
                targets.add(imported)
        edges[name] = targets
    return edges


def _import_targets(tree: ast.AST, module: str) -> list[str]:
    modules = _all_modules()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names = _imported_names(ast.Module(body=[node], type_ignores=[]), module)
            base, subs = names[0], [n for n in names[1:] if n in modules]
            out += subs if subs else [base]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (its first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def _layering_problems(edges: dict[str, set[str]]) -> list[str]:
    problems = [f"upward import: {m} -> {t}" for m, ts in sorted(edges.items()) for t in sorted(ts)
                if _layer(t) > _layer(m)]
    cycle = _cycle(edges)
    if cycle:
        problems.append("import cycle: " + " -> ".join(cycle))
    return problems


def test_imports_form_no_cycle_and_none_runs_upward():
    edges = _edges(_all_modules())
    assert "shardopt.layout" in edges["shardopt.optimizer"]  # the walk sees the imports
    assert _layering_problems(edges) == []


def test_the_layering_check_finds_cycles_and_upward_imports():
    # The check above can fail: an upward import and a cycle, each found and named.
    edges = {"shardopt.optimizer": {"shardopt.checkpoint.snapshot"},
             "shardopt.checkpoint.snapshot": {"shardopt.layout"}, "shardopt.layout": set()}
    assert _layering_problems(edges) == [
        "upward import: shardopt.optimizer -> shardopt.checkpoint.snapshot"]
    edges = {"shardopt.update": {"shardopt.layout"}, "shardopt.layout": {"shardopt.moments"},
             "shardopt.moments": {"shardopt.update"}}
    assert _layering_problems(edges) == [
        "import cycle: shardopt.layout -> shardopt.moments -> shardopt.update -> shardopt.layout"]
    for module, layer in [("shardopt.comm", 0), ("shardopt.checkpoint", 1),
                          ("shardopt.checkpoint.save", 1), ("shardopt", 2),
                          ("shardopt.recipes.integrations.lightning", 3), ("shardopt.cli", 3),
                          ("shardopt.recipes.train", 3)]:
        assert _layer(module) == layer, module
    # Imports inside functions and under TYPE_CHECKING count, and ``from X import a`` means X.a.
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from .optimizer import DistributedOptimizer\n"
                     "def f():\n    from .checkpoint import snapshot\n    from . import comm\n")
    assert set(_import_targets(tree, "shardopt.update")) >= {
        "shardopt.optimizer", "shardopt.checkpoint.snapshot", "shardopt.comm"}


def test_the_static_check_sees_relative_and_lazy_imports():
    # The check above can fail: a function-level relative import of the recipes is caught.
    tree = ast.parse("def f():\n    from ..recipes import train\n    from . import io\n")
    names = _imported_names(tree, "shardopt.checkpoint.export")
    assert "shardopt.recipes.train" in names and "shardopt.checkpoint.io" in names


def test_importing_shardopt_imports_no_framework():
    # The frameworks are optional: shardopt and shardopt.recipes.integrations import none of
    # them, each adapter module only its own.
    probe = ("import json, sys, shardopt, shardopt.checkpoint, shardopt.recipes.integrations; "
             "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & "
             f"{set(FRAMEWORKS)!r})))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(PACKAGE.parent)
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []
