"""The package's imports run one way: no module of mla/ imports, directly or through others, a
module that imports it back. Every import counts, those inside functions too. Read with `ast`
alone: nothing is imported."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mla"


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module name -> the package's modules it imports (`from . import x` counts as module x)."""
    root = package.parent
    modules = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)

    def known(name: str) -> str | None:  # the module itself, or the package that holds it
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, (path, is_package) in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                for alias in node.names:  # `from . import x`: module x, or a name of the package
                    sub = f"{module}.{alias.name}"
                    targets.add(sub if sub in modules else module)
        # A module's own packages run before it in any case: an edge to them is no loop.
        ancestors = {name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)}
        graph[name] = {m for m in map(known, targets) if m is not None and m != name} - ancestors
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_mla():
    graph = import_graph(PACKAGE)
    assert {"mla.base", "mla.tiers", "mla.cli", "mla.paged.layer", "mla.kernels.decode"} <= set(graph)
    assert "mla.base" in graph["mla.naive"] and "mla.kernels" in graph["mla.paged.layer"]
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(
        " <-> ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in found)


def test_a_cycle_through_an_import_inside_a_function_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "base.py").write_text("def build():\n    from .sub.tier import Tier\n    return Tier\n")
    (pkg / "sub" / "tier.py").write_text("from ..base import build\n")
    (pkg / "cli.py").write_text("from . import base\n")
    graph = import_graph(pkg)
    assert graph["pkg.cli"] == {"pkg.base"}
    assert cycles(graph) == [["pkg.base", "pkg.sub.tier"]]
