"""The house's shape (docs/ARCHITECTURE.md): no import circle among the package's modules, leaves that import no
layer above them, and files small enough to read. Checked on the source text (ast), so nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "src" / "dsv41"
MAX_LINES = 520  # "about 500": the CUDA sources are exempt (one translation unit per kernel family)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the package that `name` imports, at any depth of its body (lazy imports count: a circle closed
    inside a function is still a circle). `from pkg import sub` is an edge to `pkg.sub` when sub is a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = {f"{target}.{a.name}" for a in node.names} & known
            found |= subs
            if target in known and len(subs) < len(node.names):
                found.add(target)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports_of(m, p, set(mods)) for m, p in mods.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_checker_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_package():
    assert circles(import_graph()) == []


def test_leaves_import_no_layer_above_them():
    """kernels/ are functions of tensors and weights/ is storage: neither reaches up into the model, the engine,
    the server or the appliance; the model never imports the engine, the server or ops."""
    above = {
        "dsv41.kernels": ("dsv41.model", "dsv41.engine", "dsv41.server", "dsv41.parallel", "dsv41.ops",
                          "dsv41.chat", "dsv41.structured"),
        "dsv41.weights": ("dsv41.model", "dsv41.engine", "dsv41.server", "dsv41.parallel", "dsv41.ops"),
        "dsv41.model": ("dsv41.engine", "dsv41.server", "dsv41.ops", "dsv41.chat", "dsv41.structured"),
    }
    wrong = [(m, dep) for m, deps in import_graph().items() for layer, banned in above.items()
             if m.startswith(layer + ".") or m == layer for dep in deps if dep.startswith(banned)]
    assert wrong == []


def test_no_file_is_too_long_to_read():
    roots = [REPO / "src", REPO / "tests", REPO / "bench"]
    long = {str(p.relative_to(REPO)): n for root in roots for p in root.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_engine_is_torch_free_policy_and_runtime_takes_only_its_types():
    """engine/ is policy: no torch, nothing of runtime/, parallel/, model/, kernels/ or the composition root;
    runtime/ takes only the engine's step types (batch.py) and the request's sampling values (params.py); the
    composition root (compose/) is where the two meet (issue 32 item 5)."""
    graph = import_graph()
    engine = {m: deps for m, deps in graph.items() if m.startswith("dsv41.engine")}
    banned = ("dsv41.runtime", "dsv41.parallel", "dsv41.model", "dsv41.kernels", "dsv41.compose")
    assert [(m, d) for m, deps in engine.items() for d in deps if d.startswith(banned)] == []
    torch_users = []
    for name, path in modules().items():
        if name.startswith("dsv41.engine"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                torch_users += [(name, n) for n in names if n == "torch" or n.startswith("torch.")]
    assert torch_users == []
    allowed = {"dsv41.engine.batch", "dsv41.engine.params"}
    runtime = [(m, d) for m, deps in graph.items() if m.startswith("dsv41.runtime") for d in deps
               if d.startswith("dsv41.engine") and d not in allowed]
    assert runtime == []
