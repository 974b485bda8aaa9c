"""The import graph of ``knapspec_dist`` is a tower of layers: no module imports, directly or
through others, a module that imports it back (no cycle), counting every import statement,
also those inside functions, and the command layer's shared pieces sit at its bottom."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "knapspec_dist"


def modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (``from . import x`` counts x)."""
    mods = modules()
    graph = {name: set() for name in mods}
    for name, (path, is_package) in mods.items():
        here = name.split(".") if is_package else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[:len(here) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [module] + [f"{module}.{a.name}" for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in mods and t != name)
    return graph


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


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert "knapspec_dist.cli.main" in graph and graph["knapspec_dist.cli.main"]  # the walk sees imports
    assert cycles(graph) == [], "import cycles in knapspec_dist"


def test_the_shared_command_line_pieces_import_nothing_above_them():
    graph = import_graph()
    commands = {"knapspec_dist.cli.main", "knapspec_dist.jobs", "knapspec_dist.jobs.options",
                "knapspec_dist.cli.bench", "knapspec_dist.cli.profile",
                "knapspec_dist.cli.engine_commands"}
    for name in commands:  # nothing imports the top-level CLI back
        assert "knapspec_dist.cli.main" not in graph[name] or name == "knapspec_dist.cli.main"
    seen, todo = set(), ["knapspec_dist.cli.common"]
    while todo:  # everything commandline reaches, transitively
        for child in graph[todo.pop()] - seen:
            seen.add(child)
            todo.append(child)
    assert not seen & (commands | {"knapspec_dist.llm", "knapspec_dist.runtime.engine"})
    assert not any("jobs" in m or "bench" in m for m in seen)
