"""The layering contract of docs/architecture.md, checked by reading every module's imports (an `ast` walk; nothing is
imported). `violations(root)` lists each import that breaks a rule and each module-level import cycle; the tests
run it on the repository and on copies of it with a forbidden import added.

The rules, as the folders are the design:
- kernels/ imports nothing of kvchat outside kernels/;
- storage/ never imports engine/ or app/;
- engine/ never imports storage/, `kvchat.paths`, app/, click or textual;
- app/session/ (the domain core) never imports click or textual;
- app/tui/ never imports the CLI (`app/cli.py`, `app/chats.py`); the CLI may start the app;
- only the CLI imports app/bench/ (the benchmarks import each other);
- no cycle among module-level imports anywhere.
Lazy imports inside functions count for the layering rules (they run all the same), not for cycles (they do not
run at import time).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "kvchat"
TOP_FOLDERS = ("app", "engine", "storage", "kernels", "assets")
CLI_MODULES = ("kvchat.app.cli", "kvchat.app.chats")


@dataclass(frozen=True)
class Import:
    module: str   # the importing module, e.g. kvchat.engine.generate
    target: str   # what it imports, e.g. kvchat.engine.model.decoder or click
    line: int
    top_level: bool  # runs when the module is imported (not inside a function, not under TYPE_CHECKING)


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PACKAGE, *parts])


def package_files(root: Path) -> dict[str, Path]:
    files = {f"{PACKAGE}.{p.stem}": p for p in root.glob("*.py") if p.stem != "__init__"}
    files[PACKAGE] = root / "__init__.py"
    for folder in TOP_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            files[module_name(root, path)] = path
    return files


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


# A module's imports by what they are computed from: the tests check the package and copies of it that differ in one
# file, so all but that file's are read from here instead of parsed again.
_found: dict[tuple[str, bool, str, frozenset[str]], list[Import]] = {}


def imports_of(module: str, path: Path, modules: set[str]) -> list[Import]:
    text = path.read_text()
    key = (module, path.name == "__init__.py", text, frozenset(modules))
    if key not in _found:
        _found[key] = _imports_of(module, path, text, modules)
    return list(_found[key])


def _imports_of(module: str, path: Path, text: str, modules: set[str]) -> list[Import]:
    tree = ast.parse(text, filename=str(path))
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def visit(node: ast.AST, top_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False)
            elif isinstance(child, ast.If) and _is_type_checking(child):
                visit(child, False)
            elif isinstance(child, ast.Import):
                found.extend(Import(module, a.name, child.lineno, top_level) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: resolve against this module's package
                    package = module if is_package else module.rsplit(".", 1)[0]
                    for _ in range(child.level - 1):
                        package = package.rsplit(".", 1)[0]
                    base = f"{package}.{base}" if base else package
                found.append(Import(module, base, child.lineno, top_level))
                for a in child.names:  # `from kvchat.engine.model import decoder` imports a module
                    if f"{base}.{a.name}" in modules:
                        found.append(Import(module, f"{base}.{a.name}", child.lineno, top_level))
            else:
                visit(child, top_level)

    visit(tree, True)
    return found


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def rule_broken(imp: Import) -> str | None:
    """The rule `imp` breaks, in words, or None."""
    m, t = imp.module, imp.target
    if _under(m, "kvchat.kernels") and _under(t, PACKAGE) and t != PACKAGE and not _under(t, "kvchat.kernels"):
        return "kernels/ imports only kernels/"
    if _under(m, "kvchat.storage") and (_under(t, "kvchat.engine") or _under(t, "kvchat.app")):
        return "storage/ never imports engine/ or app/"
    if _under(m, "kvchat.engine") and any(_under(t, p) for p in (
            "kvchat.storage", "kvchat.paths", "kvchat.app", "click", "textual")):
        return "engine/ never imports storage/, paths, app/, click or textual"
    if _under(m, "kvchat.app.session") and any(_under(t, p) for p in ("click", "textual")):
        return "app/session/ never imports click or textual"
    if _under(m, "kvchat.app.tui") and any(_under(t, p) for p in CLI_MODULES):
        return "app/tui/ never imports the CLI"
    if _under(t, "kvchat.app.bench") and not (_under(m, "kvchat.app.bench") or m in CLI_MODULES):
        return "only the CLI imports app/bench/"
    return None


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (or a module importing itself): Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return cycles


def violations(root: Path) -> list[str]:
    files = package_files(root)
    modules = set(files)
    problems: list[str] = []
    edges: dict[str, set[str]] = {}
    for module, path in files.items():
        broken: set[tuple[int, str]] = set()  # `from a import b` is two imports on one line: reported once
        for imp in imports_of(module, path, modules):
            rule = rule_broken(imp)
            if rule and (imp.line, rule) not in broken:
                broken.add((imp.line, rule))
                problems.append(f"{path.relative_to(root)}:{imp.line} imports {imp.target}: {rule}")
            if imp.top_level and imp.target in modules and imp.target != module:
                edges.setdefault(module, set()).add(imp.target)
                # importing a.b.c first runs a.b's __init__, unless the importer lives inside a.b already
                parent = imp.target.rsplit(".", 1)[0]
                while parent != PACKAGE and not _under(module, parent):
                    edges[module].add(parent)
                    parent = parent.rsplit(".", 1)[0]
    problems += [f"import cycle: {' -> '.join(c)}" for c in import_cycles(edges)]
    return problems
