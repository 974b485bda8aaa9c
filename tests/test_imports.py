"""The package is a tower of layers, read from its real import statements.

Every import sits at the top of its module (none inside a function or class), so the import
graph a reader or a tool sees is the real one; each layer imports only the layers below it;
``ray`` is imported only by the Ray runtime and matplotlib only by plotting modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "knapspec_dist"

#: Bottom to top. A module may import its own layer and the layers below it.
LAYERS = [
    ("knapspec_dist", "knapspec_dist.errors", "knapspec_dist.clock", "knapspec_dist.ratio",
     "knapspec_dist.option_rules", "knapspec_dist.cache"),
    ("knapspec_dist.model",),
    ("knapspec_dist.parallel",),
    ("knapspec_dist.engine",),
    ("knapspec_dist.profiles",),
    ("knapspec_dist.speculation",),
    ("knapspec_dist.llm",),
    ("knapspec_dist.runtime",),
    ("knapspec_dist.jobs",),
    ("knapspec_dist.tools",),
    ("knapspec_dist.cli",),
]


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def layer_of(module: str) -> int:
    best, level = -1, None
    for i, names in enumerate(LAYERS):
        for name in names:
            hit = module == name or (name != "knapspec_dist" and module.startswith(name + "."))
            if hit and len(name) > best:
                best, level = len(name), i
    if level is None:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")
    return level


def imported(node: ast.AST) -> list[str]:
    """Absolute names an import statement brings in (``from a import b`` gives a and a.b)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            raise AssertionError(f"relative import of {node.module!r} at line {node.lineno}")
        return [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return []


def top_level_imports(tree: ast.Module) -> list[ast.stmt]:
    """Imports at module level, including those under a module-level ``if``/``try``."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", []) + [
                s for h in getattr(node, "handlers", []) for s in h.body]
    return out


def nested_imports(tree: ast.Module) -> list[ast.stmt]:
    top = {id(n) for n in top_level_imports(tree)}
    return [n for n in ast.walk(tree)
            if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in top]


def parsed() -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text(), str(path)) for name, path in modules().items()}


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules its module-level imports name."""
    mods = modules()
    return {name: {t for node in top_level_imports(tree) for t in imported(node)
                   if t in mods and t != name}
            for name, tree in parsed().items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_layer_rule_sees_a_planted_upward_import():
    assert layer_of("knapspec_dist.model.decoder") < layer_of("knapspec_dist.speculation.knapspec")
    assert layer_of("knapspec_dist.llm") < layer_of("knapspec_dist.runtime.ray_engine")
    tree = ast.parse("import os\nfrom knapspec_dist.speculation import tpt\n\n"
                     "def f():\n    import re\n")
    assert [imported(n) for n in top_level_imports(tree)] == [
        ["knapspec_dist.speculation", "knapspec_dist.speculation.tpt"], ["os"]]
    assert [imported(n) for n in nested_imports(tree)] == [["re"]]


def test_every_import_is_at_the_top_of_its_module():
    found = [f"{name}:{n.lineno} {', '.join(imported(n)[:1])}"
             for name, tree in parsed().items() for n in nested_imports(tree)]
    assert not found, "imports inside functions or classes:\n" + "\n".join(found)


def test_each_layer_imports_only_the_layers_below_it():
    graph = import_graph()
    assert graph["knapspec_dist.cli.main"]  # the walk sees imports
    upward = [f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
              for m, targets in graph.items() for t in sorted(targets)
              if layer_of(t) > layer_of(m)]
    assert not upward, "\n".join(upward)


def test_the_import_graph_has_no_cycle():
    assert cycles(import_graph()) == [], "import cycles in knapspec_dist"


@pytest.mark.parametrize("library, allowed", [
    ("ray", lambda m: m.startswith("knapspec_dist.runtime")),
    ("matplotlib", lambda m: m.rsplit(".", 1)[-1].startswith("plot")),
])
def test_heavy_libraries_sit_behind_their_layer(library, allowed):
    users = {name for name, tree in parsed().items()
             for n in ast.walk(tree) for t in imported(n)
             if t == library or t.startswith(library + ".")}
    assert users, f"nothing imports {library}: the check would be vacuous"
    misplaced = sorted(u for u in users if not allowed(u))
    assert not misplaced, f"{library} imported by " + ", ".join(misplaced)


def reached(module: str, graph: dict[str, set[str]]) -> set[str]:
    """The package modules that importing ``module`` runs: its imports and their parent
    packages' ``__init__``, transitively."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parents = [name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)]
        todo += sorted(graph[name]) + [p for p in parents if p in graph]
    return seen


def test_the_gpu_image_entry_points_reach_no_ray():
    """The GPU image has torch and transformers but no Ray: its commands (``python -m
    knapspec_dist.cli.standalone``: gpu-check, bench, throughput) and generate must import there
    (the CI lane runs them in a venv without Ray); ``knapspec`` itself reaches Ray through the
    job commands. tests/test_without_ray.py imports them with Ray hidden."""
    graph, trees = import_graph(), parsed()

    def ray_users(module: str) -> list[str]:
        return sorted({m for m in reached(module, graph) for n in top_level_imports(trees[m])
                       if any(t == "ray" or t.startswith("ray.") for t in imported(n))})

    assert ray_users("knapspec_dist.cli.main"), "the walk must see Ray behind `knapspec`"
    for module in ("knapspec_dist.cli.standalone", "knapspec_dist.engine.scheduler",
                   "knapspec_dist.llm"):
        assert not ray_users(module), f"{module} reaches ray via {ray_users(module)}"
