"""The package's import structure: no cycle among infra's modules (imports inside functions and under TYPE_CHECKING
count), recipes import from `infra` alone, and `infra` itself loads nothing heavy."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def module_graph(package: Path) -> dict[str, set[str]]:
    """Each module of `package` (a folder) and the modules of the package it imports: every `import` and `from ... import`
    anywhere in its file, with the packages Python runs on the way (importing a.b.c runs a and a.b first), but not the
    module's own parent packages (already running when it is imported)."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def resolved(name: str) -> str:
        while name and name not in modules:  # `from a.b import c`: c may be a module or a name of a.b
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                target = resolved(target) if target.split(".")[0] == package.name else ""
                while target:  # the module and each package above it
                    if target != name and not name.startswith(target + "."):
                        graph[name].add(target)
                    target = target.rpartition(".")[0]
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_module_of_infra_is_in_an_import_cycle():
    graph = module_graph(REPO / "infra")
    assert len(graph) > 60 and "infra.data" in graph["infra.job"] and "infra.replicas" in graph["infra.run"]  # it sees them
    assert cycles(graph) == []


def test_the_cycle_check_finds_cycles_through_type_checking_and_function_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.b import B\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub.b import B\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from pkg import a\n")
    (pkg / "c.py").write_text("import pkg.sub.d\n")  # a module that is not there: no edge, no error
    assert cycles(module_graph(pkg)) == [["pkg.a", "pkg.sub", "pkg.sub.b"]]
    (pkg / "sub" / "b.py").write_text("def f():\n    pass\n")
    assert cycles(module_graph(pkg)) == []


def test_recipes_import_infra_from_its_one_public_module_and_infra_never_does():
    import infra

    for path in sorted((REPO / "recipes").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "infra":
                assert {alias.name for alias in node.names} <= set(infra.__all__), path.name
    for path in sorted((REPO / "infra").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            assert not (isinstance(node, ast.ImportFrom) and node.module == "infra"), f"{path} imports the public module"
    for name in infra.__all__:  # each public name is where the table says
        assert getattr(infra, name) is getattr(__import__(infra.PUBLIC[name], fromlist=[name]), name)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        infra.Nope  # noqa: B018


def test_importing_infra_loads_no_torch():
    code = "import sys, infra, infra.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "False"
