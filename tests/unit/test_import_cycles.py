"""No import cycles between the project's modules (docs/DESIGN.md "Layering").

Every module of the packages below is parsed with `ast`; every import counts, at the top of the
module or deferred into a function (or under `if TYPE_CHECKING:`), since a deferred import that
closes a cycle is still a cycle, only one that fails later. `from pkg import name` depends on
`pkg` (its `__init__` runs and may define `name`) and, when `pkg.name` is a module, on that
module too; so a package whose `__init__` imports its submodules, one of which imports the
package back, is a cycle. import-linter's contracts order the packages; this test orders the
modules inside them.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("app", "streams", "trainer", "kernels", "policy")


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__)."""
    modules: dict[str, tuple[Path, bool]] = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            modules[".".join(parts)] = (path, is_package)
    return modules


def _owner(name: str, modules: dict) -> str | None:
    """The longest prefix of `name` that is one of our modules (None outside the project)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported(module: str, path: Path, is_package: bool, modules: dict) -> set[str]:
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base_parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.add(base)
            names.update(
                f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules
            )
    owners = {_owner(name, modules) for name in names}
    return {o for o in owners if o is not None and o != module}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imported(m, path, is_pkg, modules) for m, (path, is_pkg) in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components of more than one module, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def test_the_checker_finds_a_package_that_its_submodule_imports_back():
    graph = {"pkg": {"pkg.a"}, "pkg.a": {"pkg"}, "pkg.b": {"pkg.a"}, "other": set()}
    assert strongly_connected(graph) == [["pkg", "pkg.a"]]


def test_the_checker_reads_deferred_and_from_package_imports(tmp_path):
    modules = {"pkg": (None, True), "pkg.a": (None, False), "pkg.b": (None, False)}
    source = tmp_path / "b.py"
    source.write_text("def f():\n    from pkg import a\n    from . import b\n")
    assert _imported("pkg.b", source, False, modules) == {"pkg", "pkg.a"}


def test_no_module_import_cycles():
    graph = import_graph()
    assert len(graph) > 100, sorted(graph)  # the packages were found
    cycles = strongly_connected(graph)
    assert not cycles, "import cycles (each a strongly-connected component):\n" + "\n".join(
        ", ".join(c) for c in cycles
    )
