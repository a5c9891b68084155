"""The layers hold: protos -> arbiter -> agent -> {hyperparam_adapters, simulator, benchmarks, themis_demo}.

Every import statement of every module of those packages is read with ``ast`` -- at the top of a
file, inside functions, under ``TYPE_CHECKING``, and ``importlib.import_module`` / ``__import__``
of a literal name -- so an arrow up the layers cannot hide where a reader of the imports at the
top would miss it. A module may import from its own layer or a lower one; the packages of the top
layer may import one another (the benchmarks measure the simulator). Import circles between
modules are refused too: each is a pair of modules that cannot be understood, tested or moved
one without the other.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"protos": 0, "arbiter": 1, "agent": 2, "hyperparam_adapters": 3, "simulator": 3, "benchmarks": 3,
          "themis_demo": 3}
GENERATED = ("_pb2.py", "_pb2_grpc.py")
def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the layered packages."""
    out = {}
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name.endswith(GENERATED):
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """(imported name, line) for every import in the file, wherever it stands. ``from a import b``
    gives ``a.b`` when that is a module, else ``a``; relative imports are resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                yield (f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base), node.lineno
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in ("import_module", "__import__"):
                yield node.args[0].value, node.lineno


def _project_module(name: str) -> str | None:
    """The project module ``name`` loads (its longest prefix that is one), or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def test_no_module_imports_from_a_layer_above_its_own():
    upward = []
    for module, path in MODULES.items():
        own = LAYERS[module.split(".")[0]]
        for name, line in _imports(module, path):
            top = name.split(".")[0]
            if top in LAYERS and LAYERS[top] > own:
                upward.append(f"{path.relative_to(ROOT)}:{line}: {module} imports {name} "
                              f"(layer {LAYERS[top]} above its own, {own})")
    assert not upward, "imports up the layers (protos -> arbiter -> agent -> the rest):\n" + "\n".join(upward)


def _circles() -> set[frozenset[str]]:
    """The strongly connected groups of two or more modules in the import graph. An import of a
    module's own package (``from agent import executors`` inside ``agent.executors.base``) is no
    edge: Python initialises a package before any module in it, whatever the module imports."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        targets = {_project_module(name) for name, _ in _imports(module, path)}
        graph[module] = {t for t in targets if t and t != module and not module.startswith(t + ".")}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for root in sorted(graph):  # Tarjan's algorithm, iterative (no recursion limit on deep chains)
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.add(frozenset(group))
    return found


def test_no_import_circles():
    circles = sorted(sorted(c) for c in _circles())
    assert not circles, f"import circles (break each, e.g. by moving what both sides need below them): {circles}"


def test_the_check_sees_imports_inside_functions_and_under_type_checking(tmp_path):
    """The reader finds what a top-of-file scan would miss (the way the old arrows hid)."""
    path = tmp_path / "probe.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from agent.tuner import TunerAdapter\n"
                    "def f():\n    from simulator.engine import Simulation\n    import importlib\n"
                    "    importlib.import_module('themis_demo.service')\n")
    names = {name for name, _ in _imports("arbiter.probe", path)}
    assert {"agent.tuner", "simulator.engine", "themis_demo.service"} <= names
