"""The import graph of the `pipeline` package, read with `ast` (no module is imported).

A module's imports are every ``import`` / ``from ... import`` statement anywhere in it: function
bodies (lazy imports) and ``if TYPE_CHECKING:`` blocks included (a loop of types is a loop). An edge
goes to the module named; ``from pipeline.x import y`` goes to ``pipeline.x.y`` when that is a
module, else to ``pipeline.x``. Loops are the strongly connected components of more than one
module (or a module importing itself).

Worked example: ``pipeline/a.py`` holding ``def f(): from pipeline.b import g`` and
``pipeline/b.py`` holding ``import pipeline.a`` form the loop ``{pipeline.a, pipeline.b}``.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pipeline"
#: Packages of entry points (processes a user or launcher starts); every other module is a library
#: module, which imports none of these (docs/architecture.md).
ENTRY_PACKAGES = ("pipeline.apps", "pipeline.roles")


@dataclass
class Import:
    target: str
    """The module imported (``pipeline.x.y``, or an outside module's dotted name)."""
    names: list[str]
    """The names a ``from`` import takes (empty for ``import x``)."""
    line: int


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    imports: list[Import] = field(default_factory=list)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_entry(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in ENTRY_PACKAGES)


def load() -> dict[str, Module]:
    """Every module of the package, with its imports."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        modules[name] = Module(name, path, ast.parse(path.read_text(), str(path)))
    for mod in modules.values():
        mod.imports = list(_imports(mod, modules))
    return modules


def _imports(mod: Module, modules: dict[str, Module]):
    package = mod.name if mod.path.name == "__init__.py" else mod.name.rpartition(".")[0]
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(alias.name, [], node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [a.name for a in node.names]
            subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in modules]
            rest = [n for n in names if f"{base}.{n}" not in modules]
            for sub in subs:
                yield Import(sub, [], node.lineno)
            if rest or not subs:
                yield Import(base, rest, node.lineno)


def edges(modules: dict[str, Module]) -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    return {m.name: {i.target for i in m.imports if i.target in modules and i.target != m.name}
            for m in modules.values()}


def loops(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    graph = edges(modules)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # recursion depth is bounded by the module count (~150)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def upward_imports(modules: dict[str, Module]) -> list[str]:
    """``module:line -> target`` for each import of an entry package by a library module."""
    return [f"{m.name}:{i.line} -> {i.target}" for m in modules.values() if not is_entry(m.name)
            for i in m.imports if i.target.startswith("pipeline.") and is_entry(i.target)]


def private_imports(modules: dict[str, Module]) -> list[str]:
    """``module:line -> target.name`` for each ``_private`` name taken from another package module."""
    return [f"{m.name}:{i.line} -> {i.target}.{n}" for m in modules.values() for i in m.imports
            if i.target in modules and i.target != m.name
            for n in i.names if n.startswith("_") and not n.startswith("__")]


def calls_of(modules: dict[str, Module], package: str) -> list[str]:
    """``module:line`` of each import of ``package`` (or a module of it)."""
    return [f"{m.name}:{i.line}" for m in modules.values() for i in m.imports
            if i.target == package or i.target.startswith(package + ".")]
