"""The package's import graph is layered: no cycle but a few named back-references.

The graph is built from the source with ``ast``: imports inside functions
count (they are the easy way to hide a cycle), imports under
``if TYPE_CHECKING:`` do not (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dask_monarch"

# (module, module it imports): the only edges allowed to close a cycle. Each is a convenience
# method of a lower module reaching the module that implements it, imported inside the method.
BACK_REFERENCES = {
    ("tensor", "collectives"): "Tensor.reduce and Tensor.reduce_",
    ("tensor", "transfer"): "Tensor.to_mesh and Tensor.slice_mesh",
    ("mesh", "remote_function"): "DeviceMesh.rank runs a remote function",
    ("mesh", "actor_mesh"): "DeviceMesh.spawn makes an ActorMesh",
    ("mesh", "random"): "device_mesh routes torch.manual_seed and the rng states through dm.random",
}
# Worker modules other layers may import directly; everything else goes through the
# ``dask_monarch.worker`` package's entry points.
WORKER_MODULES_SHARED = {
    ("remote_function", "worker.calls"): "a remote function's path resolves as on the worker",
}

# Top-level modules below the user API: shared by every layer, or one-line aliases of a layer's
# module kept as public import paths.
SHARED = {"config", "exceptions", "messages", "ndslice", "preload", "dashboard", "logs"}
SHARED |= {"dask_internals"}  # distributed's private parts, behind one module
LOWER_LAYERS = ("protocol", "controller", "worker", "deployment")


def _modules() -> dict[str, Path]:
    """Module names relative to the package ("tensor", "controller.session"), with paths."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            modules[".".join(parts)] = path
    return modules


def _graph() -> dict[str, dict[str, bool]]:
    """module -> {imported module: imported at module level?} within the package."""
    modules = _modules()
    graph: dict[str, dict[str, bool]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges: dict[str, bool] = {}
        for node, top in _located_imports(tree):
            for target in _targets(node, package):
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[target] = edges.get(target, False) or top
        graph[name] = edges
    return graph


def _located_imports(tree: ast.Module):
    """(import node, at module level?) pairs; module level means outside any function."""

    def walk(node, top):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for n in child.orelse:
                    yield from walk_one(n, top)
                continue
            yield from walk_one(child, top)

    def walk_one(node, top):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, top
        inner = top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from walk(node, inner)

    yield from walk(tree, True)


def _targets(node: ast.Import | ast.ImportFrom, package: list[str]) -> list[str]:
    """The package-relative modules an import names (a name may be a submodule)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
        return [n.removeprefix("dask_monarch.") for n in names if n.startswith("dask_monarch.")]
    if node.level:
        base = package[: len(package) - (node.level - 1)]
    elif node.module and node.module.split(".")[0] == "dask_monarch":
        base = []
    else:
        return []
    module = node.module or ""
    if not node.level:
        module = module.removeprefix("dask_monarch").lstrip(".")
    target = ".".join(base + ([module] if module else []))
    return [f"{target}.{a.name}".lstrip(".") for a in node.names]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
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
            strong(v)
    return found


def _user_api() -> set[str]:
    """The top-level modules (not the layers' packages) that are not shared."""
    return {
        name
        for name, path in _modules().items()
        if "." not in name and path.name != "__init__.py" and name not in SHARED
    }


def test_the_graph_sees_imports_inside_functions_and_skips_type_checking():
    graph = _graph()
    assert graph["tensor"]["stream"] is True  # at module level
    assert graph["tensor"]["collectives"] is False  # inside Tensor.reduce
    assert "mesh" not in graph["tensor"]  # only under TYPE_CHECKING
    assert graph["controller.session"]["controller.controller"] is True
    assert graph["tensor"]["protocol.messages"] is True  # "from .protocol import messages"


def test_no_import_cycle_but_the_named_back_references():
    graph = _graph()
    for (module, imported), why in BACK_REFERENCES.items():
        assert imported in graph[module], f"stale back-reference {module} -> {imported} ({why})"
        assert graph[module][imported] is False, (
            f"{module} imports {imported} at module level: a back-reference is imported inside "
            f"the convenience method that needs it ({why})"
        )
    acyclic = {m: {t for t in edges if (m, t) not in BACK_REFERENCES} for m, edges in graph.items()}
    assert _cycles(acyclic) == []


def test_lower_layers_never_import_the_user_api():
    graph = _graph()
    user_api = _user_api()
    assert {"tensor", "mesh", "stream", "compiled", "remote_function"} <= user_api
    assert not user_api & {"controller", "worker", "protocol"}
    for module, edges in graph.items():
        if module.split(".")[0] in LOWER_LAYERS:
            wrong = sorted(set(edges) & user_api)
            assert not wrong, f"{module} (below the user API) imports {wrong}"


def test_other_layers_reach_the_worker_through_its_package():
    graph = _graph()
    for (module, imported), why in WORKER_MODULES_SHARED.items():
        assert imported in graph[module], f"stale exception {module} -> {imported} ({why})"
    for module, edges in graph.items():
        if module.split(".")[0] == "worker":
            continue
        inner = sorted(
            t for t in edges if t.startswith("worker.") and (module, t) not in WORKER_MODULES_SHARED
        )
        assert not inner, f"{module} imports worker internals {inner}: use dask_monarch.worker"
