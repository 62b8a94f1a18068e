"""The lab's imports, walked with `ast`: which lab modules each module imports, and the cycles among them.

Used by tests/test_public_api.py (packages: module-level imports only) and tests/test_imports.py (modules, with
the imports inside functions too). As a script it prints every module cycle:

    python tests/import_graph.py
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAB = REPO / "lab"
_BODIES = ("body", "orelse", "finalbody", "handlers")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def lab_modules() -> dict[str, Path]:
    mods = {}
    for path in sorted(LAB.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        mods[module_name(path)] = path
    return mods


def imports(tree: ast.Module, name: str, is_package: bool, modules, in_functions: bool = False) -> set[str]:
    """The lab modules (of ``modules``) a module imports: in its top-level code (inside if/try/with/class bodies
    too) and, with ``in_functions``, in its functions as well. `from lab.x import y` imports lab.x.y when y is a
    module, else lab.x."""
    found: set[str] = set()
    package = name if is_package else name.rpartition(".")[0]

    def visit(stmts):
        for node in stmts:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not in_functions:
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module
                named = {f"{target}.{a.name}" for a in node.names}
                found.update(named & set(modules))
                if named - set(modules):  # a name defined in lab.x (a function, a class)
                    found.add(target)
            for field in _BODIES:
                visit(getattr(node, field, None) or [])

    visit(tree.body)
    return {m for m in found if m in modules}


def module_graph(in_functions: bool = True) -> dict[str, set[str]]:
    """{lab module: the other lab modules it imports}. `from lab.run import faults` is an edge to lab.run.faults,
    not to lab.run; the packages a dotted import passes through are not edges (lab/__init__.py is lazy)."""
    mods = lab_modules()
    graph = {}
    for name, path in mods.items():
        graph[name] = imports(ast.parse(path.read_text()), name, path.name == "__init__.py", mods, in_functions)
        graph[name].discard(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every node on an import cycle, as the cycle (Tarjan's strongly connected components), sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
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
            strong(v)
    return sorted(out)


def cycle_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """The edges that lie on a cycle: both ends in one strongly connected component."""
    where = {m: i for i, comp in enumerate(cycles(graph)) for m in comp}
    return {(a, b) for a, targets in graph.items() for b in targets if a in where and where[a] == where.get(b)}


if __name__ == "__main__":
    for label, flag in (("module level", False), ("module level and inside functions", True)):
        found = cycles(module_graph(in_functions=flag))
        print(f"{label}: {len(found)} cycle(s)")
        for comp in found:
            print("  " + " <-> ".join(comp))
