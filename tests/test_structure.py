"""The tree's rules, read from the source with ``ast`` (nothing is imported):

- no import circle among the project's modules, lazy imports inside functions and ``TYPE_CHECKING``
  imports included (an edge in ``ALLOWED_LAZY`` is left out, with its reason);
- no import across the service boundaries: ``shared`` imports nothing of the project's; ``producer``,
  ``router`` and ``worker`` import only ``shared`` and themselves (they meet through Redis); ``lightq``
  (the CLI and launcher) may import all of them; none imports ``bench`` or ``tests``;
- ``worker/engine/**`` imports no torch (nor triton, which imports torch) when imported: module-level
  imports, followed through the project's modules and the packages above them (``TYPE_CHECKING``
  imports and imports inside functions do not run at import, so they do not count here).
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shared", "producer", "router", "worker", "lightq")
OTHER_TOP_LEVEL = ("bench", "tests")  # project code that no package may import
MAY_IMPORT = {
    "shared": {"shared"},
    "producer": {"producer", "shared"},
    "router": {"router", "shared"},
    "worker": {"worker", "shared"},
    "lightq": set(PACKAGES),
}
TORCH_FREE = "worker.engine"
TORCH = ("torch", "triton")

# (importer, imported) -> why the edge may close a circle. Empty: the tree has none.
ALLOWED_LAZY: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # a project module, or the top-level name of an outside one
    line: int
    lazy: bool  # inside a function: runs when the function is called
    type_only: bool  # under ``if TYPE_CHECKING``: never runs

    @property
    def at_import(self) -> bool:
        return not (self.lazy or self.type_only)

    def where(self) -> str:
        kind = " (lazy)" if self.lazy else " (TYPE_CHECKING)" if self.type_only else ""
        return f"{module_path(self.source)}:{self.line} imports {self.target}{kind}"


@cache
def modules() -> dict[str, Path]:
    """Every module of the project's packages by dotted name (a package by its own name)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def module_path(name: str) -> str:
    return str(modules()[name].relative_to(ROOT))


def is_package(name: str) -> bool:
    return modules()[name].name == "__init__.py"


def resolve(name: str) -> str | None:
    """The project module that ``import name`` loads last (its longest known prefix), or None."""
    while name and name not in modules():
        name = name.rpartition(".")[0]
    return name or None


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class Collector(ast.NodeVisitor):
    def __init__(self, module: str) -> None:
        self.module = module
        self.imports: list[Import] = []
        self.depth = 0  # functions entered
        self.type_only = 0  # TYPE_CHECKING blocks entered

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if not is_type_checking(node.test):
            self.generic_visit(node)
            return
        self.type_only += 1
        for child in node.body:
            self.visit(child)
        self.type_only -= 1
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self.absolute(node)
        for alias in node.names:
            # `from a import b` loads the module a.b when there is one, else takes a name out of a
            name = f"{base}.{alias.name}"
            self.add(name if resolve(name) == name else base, node.lineno)

    def absolute(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        package = self.module if is_package(self.module) else self.module.rpartition(".")[0]
        parts = package.split(".")
        parts = parts[: len(parts) - (node.level - 1)]
        return ".".join(parts + ([node.module] if node.module else []))

    def add(self, name: str, line: int) -> None:
        target = resolve(name) or name.partition(".")[0]
        if target != self.module:
            self.imports.append(Import(self.module, target, line, self.depth > 0, self.type_only > 0))


@cache
def imports_of(module: str) -> tuple[Import, ...]:
    collector = Collector(module)
    collector.visit(ast.parse(modules()[module].read_text(), filename=str(modules()[module])))
    return tuple(collector.imports)


def project_edges() -> dict[str, list[Import]]:
    """Imports among the project's modules, for the circles: a package's ``__init__`` importing its
    own submodules is how a package is built, not a circle, unless a submodule imports it back."""
    return {
        module: [i for i in imports_of(module) if i.target in modules() and (i.source, i.target) not in ALLOWED_LAZY]
        for module in modules()
    }


def strongly_connected(graph: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def shortest_circle(start: str, edges: dict[str, list[Import]], within: set[str]) -> list[Import]:
    """The shortest chain of imports from ``start`` back to itself inside one component."""
    came_by: dict[str, Import] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for edge in edges[node]:
            if edge.target not in within or edge.target in came_by:
                continue
            came_by[edge.target] = edge
            if edge.target == start:
                chain = [edge]
                while chain[-1].source != start:
                    chain.append(came_by[chain[-1].source])
                return chain[::-1]
            queue.append(edge.target)
    raise AssertionError(f"{start} is in a component but on no circle")


def test_the_parse_sees_the_tree():
    # a guard against passing vacuously: the modules and a few known edges are there
    assert len(modules()) > 100
    assert "worker.engine.engine" in modules() and is_package("worker.engine")
    targets = {i.target for i in imports_of("worker.engine.engine")}
    assert {"shared.schemas", "worker.engine.request", "logging"} <= targets
    assert any(i.type_only for i in imports_of("worker.engine.engine"))


def test_no_import_circle():
    edges = project_edges()
    components = strongly_connected({m: [i.target for i in found] for m, found in edges.items()})
    report = []
    for component in components:
        chain = shortest_circle(component[0], edges, set(component))
        report.append(
            f"circle among {len(component)} modules ({', '.join(component)}), e.g.:\n    "
            + "\n    ".join(edge.where() for edge in chain)
        )
    hint = "import circles (break them, or allow a lazy edge in ALLOWED_LAZY with a reason):"
    assert not report, "\n".join([hint, *report])


def test_allowed_lazy_edges_still_exist():
    for (source, target), reason in ALLOWED_LAZY.items():
        assert reason, f"{source} -> {target} needs a reason"
        lazy = [i for i in imports_of(source) if i.target == target and not i.at_import]
        assert lazy, f"ALLOWED_LAZY names {source} -> {target}, which is no longer a lazy import: drop it"


def test_no_import_across_service_boundaries():
    offending = []
    for module in modules():
        service = module.partition(".")[0]
        for found in imports_of(module):
            top = found.target.partition(".")[0]
            crossing = top in PACKAGES and top not in MAY_IMPORT[service]
            if crossing or top in OTHER_TOP_LEVEL:
                offending.append(found.where())
    assert not offending, (
        "imports across the service boundaries (shared imports none of the project; producer, router and "
        "worker import only shared and themselves; only lightq imports them all):\n  " + "\n  ".join(offending)
    )


def loaded_with(module: str) -> list[str]:
    """The project module itself and the packages whose ``__init__`` runs before it."""
    parts = module.split(".")
    return [".".join(parts[:n]) for n in range(1, len(parts) + 1) if ".".join(parts[:n]) in modules()]


def torch_chain(start: str) -> list[Import] | None:
    """A chain of at-import imports from ``start`` to torch or triton, or None."""
    came_by: dict[str, Import | None] = {name: None for name in loaded_with(start)}
    queue = deque(came_by)
    while queue:
        node = queue.popleft()
        for found in imports_of(node):
            if not found.at_import:
                continue
            if found.target.partition(".")[0] in TORCH:
                chain = [found]
                while (edge := came_by[chain[-1].source]) is not None:
                    chain.append(edge)
                return chain[::-1]
            for name in loaded_with(found.target) if found.target in modules() else []:
                if name not in came_by:
                    came_by[name] = found
                    queue.append(name)
    return None


def test_engine_imports_no_torch():
    engine = [m for m in modules() if m == TORCH_FREE or m.startswith(TORCH_FREE + ".")]
    assert len(engine) > 3
    offending = {}
    for module in engine:
        chain = torch_chain(module)
        if chain is not None:
            offending[module] = "\n    ".join(edge.where() for edge in chain)
    assert not offending, f"{TORCH_FREE} must import no torch; these do, at import:\n  " + "\n  ".join(
        f"{module}:\n    {chain}" for module, chain in offending.items()
    )
