"""The README and docs/ cite only what exists: paths, modules, CLI commands and config keys.

What counts as a citation (inside `code spans` and fenced blocks of README.md and docs/*.md):
- a repository path: text starting with one of the repository's top-level folders or files
  (``pipeline/trainer/engine.py``, ``docs/rollout-log.md``, ``slurm/train.sbatch``); a path with a
  placeholder (``<role>``, ``N``, ``*``, ``K``) is matched as a pattern against the tree;
- a module: ``pipeline.x.y`` (a module, or a module attribute such as ``pipeline.x.fn``);
- a class or other CamelCase name (``TorchDistChannel``, ``AsyncLLM``): named somewhere in the
  project's own code or scripts (ours or a dependency's that we use), so a renamed class is caught;
- a command: ``tokenflow NAME`` (a subcommand of `pipeline.cli.COMMANDS`);
- a config key: ``section.field[.field...]`` whose first part is a section of `TokenflowConfig`
  (``trainer.loss.correction=icepop``): every part must be a field of the structured config, except
  below a field typed as a mapping (free keys such as ``task.chat_template_kwargs.X``).
And `docs/architecture.md` names every package of `pipeline/`.
"""
from __future__ import annotations

import dataclasses
import importlib
import re
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = sorted(p.name for p in ROOT.iterdir() if not p.name.startswith(".") and p.name not in ("runs", "outputs"))
SPAN = re.compile(r"```[^\n]*\n(.*?)```|`([^`\n]+)`", re.S)
PATH = re.compile(r"(?<![\w./-])((?:%s)(?:/[\w.<>*{}\-]+)*/?)" % "|".join(re.escape(t) for t in TOP))
MODULE = re.compile(r"(?<![\w./])(pipeline(?:\.\w+)+)")
CLASS = re.compile(r"(?<![\w.$-])([A-Z][a-z0-9]+(?:[A-Z][A-Za-z0-9]*)+)(?![\w-])")
COMMAND = re.compile(r"(?<![\w/.-])tokenflow\s+([a-z][\w-]*)")
PLACEHOLDER = re.compile(r"<[^>]*>|\{[^}]*\}|\*|(?<=[-/])[A-Z]+(?=[./-]|$)")


def _code(text: str) -> list[str]:
    return [m.group(1) or m.group(2) for m in SPAN.finditer(text)]


def _citations(kind: re.Pattern) -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for span in _code(doc.read_text()):
            found += [(doc.relative_to(ROOT).as_posix(), m.group(1)) for m in kind.finditer(span)]
    return found


def _path_exists(cited: str) -> bool:
    """A path, a path pattern, or ``dir/module.attr`` (an attribute of ``dir/module.py``)."""
    cited = cited.rstrip("/.")
    if PLACEHOLDER.search(cited):
        return any(ROOT.glob(PLACEHOLDER.sub("*", cited)))
    if (ROOT / cited).exists():
        return True
    module, _, attr = cited.rpartition(".")
    source = ROOT / f"{module}.py"
    return bool(module) and source.is_file() and re.search(rf"\b{re.escape(attr)}\b", source.read_text()) is not None


def _module_exists(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _config_sections() -> dict[str, type]:
    from pipeline.config import TokenflowConfig

    hints = typing.get_type_hints(TokenflowConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(TokenflowConfig)}


def _key_exists(key: str) -> bool:
    sections = _config_sections()
    head, *rest = key.split(".")
    node: typing.Any = sections[head]
    for part in rest:
        node = _unwrap(node)
        if typing.get_origin(node) in (dict, typing.Mapping) or node in (dict, typing.Any):
            return True  # free keys below a mapping field
        if not dataclasses.is_dataclass(node):
            return False
        hints = typing.get_type_hints(node)
        if part not in hints:
            return False
        node = hints[part]
    return True


def _unwrap(tp: typing.Any) -> typing.Any:
    """Optional[X] -> X (the config's only union)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)) \
        and len(args) == 1 else tp


#: last parts that make a dotted name a file name (``model.safetensors.index.json``), not a key
FILE_SUFFIXES = {"json", "safetensors", "py", "h5", "yaml", "md", "txt", "out", "png", "tfj", "jsonl", "csv"}


def _config_keys() -> list[tuple[str, str]]:
    sections = "|".join(_config_sections())
    key = re.compile(r"(?<![\w./+-])\+?((?:%s)(?:\.[a-z_][a-z0-9_]*)+)(?=[=\s,)`:]|$)" % sections)
    return [(d, k) for d, k in _citations(key) if k.rsplit(".", 1)[1] not in FILE_SUFFIXES]


def _source_words() -> set[str]:
    words: set[str] = set()
    for folder in ("pipeline", "megatron_patches", "bench", "scripts", "slurm", "tests", "configs"):
        for f in (ROOT / folder).rglob("*"):
            if f.is_file() and f.suffix in (".py", ".sh", ".yaml", ".sbatch", ".conf") and f.name != "test_docs.py":
                words.update(re.findall(r"[A-Za-z_]\w*", f.read_text(errors="replace")))
    return words


def _in_dependencies(name: str) -> bool:
    """Named in the source of a dependency the docs discuss (vLLM, megatron-core, torch, transformers)."""
    import importlib.util
    import subprocess

    for package in ("vllm", "megatron.core", "torch", "transformers"):
        spec = importlib.util.find_spec(package)
        if spec and spec.submodule_search_locations and subprocess.run(
                ["grep", "-rqw", "--include=*.py", name, *spec.submodule_search_locations]).returncode == 0:
            return True
    return False


@pytest.mark.parametrize("kind", ["path", "module", "class", "command", "config key"])
def test_every_citation_exists(kind):
    if kind == "path":
        bad = [(d, c) for d, c in _citations(PATH) if not _path_exists(c)]
    elif kind == "module":
        bad = [(d, c) for d, c in _citations(MODULE) if not _module_exists(c)]
    elif kind == "class":
        words = _source_words()
        unknown = {c for _, c in _citations(CLASS)} - words
        external = {c for c in unknown if _in_dependencies(c)}
        bad = [(d, c) for d, c in _citations(CLASS) if c in unknown - external]
    elif kind == "command":
        from pipeline.cli import COMMANDS

        bad = [(d, c) for d, c in _citations(COMMAND) if c not in COMMANDS]
    else:
        bad = [(d, c) for d, c in _config_keys() if not _key_exists(c)]
    assert not bad, f"{kind}s cited in the docs that do not exist:\n" + "\n".join(f"  {d}: {c}" for d, c in bad)


def test_the_checker_catches_a_dangling_reference():
    assert not _path_exists("pipeline/no_such_module.py")
    assert _path_exists("pipeline/trainer/engine.py") and _path_exists("runs/<name>/x") is False
    assert not _module_exists("pipeline.trainer.no_such_thing")
    assert _module_exists("pipeline.cli.COMMANDS")
    assert _key_exists("trainer.lr") and not _key_exists("trainer.no_such_field")


def test_architecture_names_every_package():
    text = (ROOT / "docs" / "architecture.md").read_text()
    packages = sorted(p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "pipeline").rglob("__init__.py"))
    missing = [p for p in packages if f"{p}/" not in text and p.replace("/", ".") not in text]
    assert not missing, f"docs/architecture.md does not name these packages: {missing}"


def test_the_readme_is_a_first_page_and_no_doc_line_is_a_wall():
    """README.md at most 170 lines; no line of it or of docs/ over 400 characters (a table cell that
    long is a page of its own: link it)."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 170
    walls = [(doc.relative_to(ROOT).as_posix(), n, len(line)) for doc in DOCS
             for n, line in enumerate(doc.read_text().splitlines(), 1) if len(line) > 400]
    assert not walls, f"lines over 400 characters (doc, line, length): {walls}"
