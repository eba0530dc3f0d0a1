"""No import circles inside aflow_rl/ and workers/.

The graph is read from the source with ast, so every import counts: module level, inside a function (the
usual way a circle is hidden rather than broken) and under ``if TYPE_CHECKING``. An edge joins two modules
of the repository; a circle is a strongly connected component of more than one module (Tarjan)."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREES = ("aflow_rl", "workers")


def module_files(root: str, trees=TREES) -> dict[str, str]:
    """{dotted module name: path} for every .py file under the trees (a package is its __init__)."""
    mods = {}
    for tree in trees:
        for d, _, files in os.walk(os.path.join(root, tree)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(d, f)
                    name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                    mods[name.removesuffix(".__init__")] = path
    return mods


def _imported_names(name: str, path: str) -> set[str]:
    """Every dotted name an import statement of the module mentions (relative ones made absolute)."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import submodule`
    return names


def import_graph(root: str, trees=TREES) -> dict[str, set[str]]:
    """{module: the repository modules it imports}; a name resolves to its longest known prefix."""
    mods = module_files(root, trees)
    graph = {}
    for name, path in mods.items():
        edges = set()
        for target in _imported_names(name, path):
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (iterative Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start), on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w), on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
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
                    found.append(sorted(component))
    return found


def test_no_import_cycles():
    graph = import_graph(ROOT)
    assert "aflow_rl.envs.swarm.policies" in graph and "workers.swarm" in graph  # the walk saw the trees
    found = cycles(graph)
    assert not found, "import circles (move what both sides need into a module of its own): " + "; ".join(
        " <-> ".join(c) for c in found)


def test_cycle_finder_sees_hidden_circles(tmp_path):
    """The check can fail: a circle through a function-level import, one through a TYPE_CHECKING import
    with a relative import, and a clean chain beside them."""
    pkg = tmp_path / "aflow_rl"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "def f():\n    from aflow_rl.b import g\n",
        "b.py": "from aflow_rl import a\n",
        "sub/__init__.py": "",
        "sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import X\n",
        "sub/d.py": "from aflow_rl.sub.c import Y\nimport os\n",
        "e.py": "import aflow_rl.b\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    found = cycles(import_graph(str(tmp_path), trees=("aflow_rl",)))
    assert sorted(found) == [["aflow_rl.a", "aflow_rl.b"], ["aflow_rl.sub.c", "aflow_rl.sub.d"]]
