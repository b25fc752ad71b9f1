"""The package's structure rules (`docs/architecture.md`), checked on the source with `ast`
(`support.import_graph`; no module is imported):

- no import loop between `pipeline` modules (lazy and ``TYPE_CHECKING`` imports count);
- no library module imports an entry package (`pipeline.apps`, `pipeline.roles`);
- no ``msgpack`` outside `pipeline/protocol/` (every cross-process byte has one home);
- no private (``_name``) name imported from another package module;
- no control path reads a message's metadata dict (``msg.meta.get(...)``, ``msg.meta[...]``, or
  ``meta.get("...")`` in a module that talks over a socket): records are decoded by type
  (`pipeline.protocol.codec`); and the orchestrator's scoring is an interface, not probed with
  ``hasattr(self.scoring, ...)``.
"""
from __future__ import annotations

import ast
import re

import pytest

from support import import_graph

#: Modules that still call msgpack outside pipeline/protocol/ on this branch: their channels are
#: being rewritten and declared in pipeline/protocol/ by issue #30 (security of every channel).
#: Known cases, listed so that any other one fails; the lead resolves them at merge.
MSGPACK_PENDING: set[str] = set()


#: Modules that talk to other processes directly (a socket or a serialiser): a control path.
TRANSPORT_MODULES = ("zmq", "msgpack", "pipeline.protocol.wire", "pipeline.protocol.transport")


@pytest.fixture(scope="module")
def modules():
    return import_graph.load()


def test_no_import_loop_between_pipeline_modules(modules):
    assert import_graph.loops(modules) == []


def test_no_library_module_imports_an_entry_package(modules):
    assert import_graph.upward_imports(modules) == []


def test_msgpack_is_called_only_in_the_protocol_package(modules):
    outside = {where.rpartition(":")[0] for where in import_graph.calls_of(modules, "msgpack")
               if not where.startswith("pipeline.protocol.")}
    assert outside - MSGPACK_PENDING == set()


def test_no_private_name_is_imported_across_modules(modules):
    assert import_graph.private_imports(modules) == []


def _meta_reads(mod: import_graph.Module, talks: bool) -> list[str]:
    out = []
    for node in ast.walk(mod.tree):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            target = node.func.value
        elif isinstance(node, ast.Subscript):
            target = node.value
        if isinstance(target, ast.Attribute) and target.attr == "meta":
            out.append(f"{mod.name}:{node.lineno}: {ast.unparse(node)[:80]}")
        elif talks and isinstance(target, ast.Name) and target.id == "meta" and isinstance(node, ast.Call) \
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            out.append(f"{mod.name}:{node.lineno}: {ast.unparse(node)[:80]}")
    return out


def test_no_control_path_reads_a_message_metadata_dict(modules):
    found = []
    for mod in modules.values():
        if mod.name.startswith("pipeline.protocol."):
            continue  # the codec itself
        talks = any(i.target == t or i.target.startswith(t + ".") for i in mod.imports for t in TRANSPORT_MODULES)
        found += _meta_reads(mod, talks)
    assert found == []


def test_the_orchestrator_never_probes_its_scoring_with_hasattr(modules):
    probes = [f"{m.name}:{n + 1}" for m in modules.values()
              for n, line in enumerate(m.path.read_text().splitlines()) if re.search(r"hasattr\(self\.scoring\b", line)]
    assert probes == []


def test_the_rules_catch_what_they_forbid(tmp_path, monkeypatch):
    """Each rule fails on a small package that breaks it (the checks above could otherwise pass by
    finding nothing at all)."""
    pkg = tmp_path / "pipeline"
    (pkg / "apps").mkdir(parents=True)
    (pkg / "protocol").mkdir()
    for init in (pkg, pkg / "apps", pkg / "protocol"):
        (init / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pipeline.b import g\n")
    (pkg / "b.py").write_text("import pipeline.a\nfrom pipeline.c import _hidden\nimport msgpack\n")
    (pkg / "c.py").write_text("from pipeline.apps import run\nimport zmq\n"
                              "def h(msg, meta):\n    return msg.meta.get('x'), meta.get(\"y\")\n")
    (pkg / "protocol" / "wire.py").write_text("import msgpack\n")
    monkeypatch.setattr(import_graph, "ROOT", tmp_path)
    monkeypatch.setattr(import_graph, "PACKAGE", pkg)
    mods = import_graph.load()
    assert import_graph.loops(mods) == [["pipeline.a", "pipeline.b"]]
    assert import_graph.upward_imports(mods) == ["pipeline.c:1 -> pipeline.apps"]
    assert import_graph.private_imports(mods) == ["pipeline.b:2 -> pipeline.c._hidden"]
    assert sorted(import_graph.calls_of(mods, "msgpack")) == ["pipeline.b:3", "pipeline.protocol.wire:1"]
    assert len(_meta_reads(mods["pipeline.c"], talks=True)) == 2


def test_test_modules_have_unique_basenames():
    """Test modules are imported by basename (`tests/conftest.py`): two with one name would shadow."""
    names = [p.name for p in import_graph.ROOT.joinpath("tests").rglob("test_*.py")]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
