"""Every import is declared, and everything declared is installed.

Each third-party module that aflow_rl/, workers/ or train.py imports must come from a distribution
in setup.py's install_requires (an import inside a function, an optional feature, may come from an
extra instead); each one tests/ imports, from install_requires or extras_require["test"]. A module
that is here only by chance (the system Python, a transitive dependency of something else) fails
this test instead of failing a new user's fresh venv at collection time.
"""
import ast
import importlib.metadata
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNTIME_TREES = ("aflow_rl", "workers", "train.py")
TEST_TREES = ("tests",)
# Imported, deliberately declared nowhere; each with the reason.
UNDECLARED_OK = {
    "aflow_rl_no_such_dependency": "tests/rollout/broken_worker.py: a worker whose import must fail",
    "sglang": "tests/serving/sglang_reference.py runs SGLang's frontend and auth code when sglang is installed "
              "(pip install --no-deps sglang pybase64 msgspec pyzmq ipython); its declared dependencies are GPU-sized",
}
# Calls that import the module named by their first (constant) argument.
_IMPORT_CALLS = {"import_module", "importorskip", "__import__"}


def _norm(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(req: str) -> str:
    return _norm(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req).group(0))


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    """(install_requires, {extra: requirements}) read from setup.py's setup() call without running it."""
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
    base = {_requirement_name(r) for r in kw["install_requires"]}
    extras = {name: {_requirement_name(r) for r in reqs} for name, reqs in kw["extras_require"].items()}
    return base, extras


def _py_files(tree: str) -> list[str]:
    path = os.path.join(ROOT, tree)
    if path.endswith(".py"):
        return [path]
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".py"))


def _local_names() -> set[str]:
    """Top-level names that resolve to this repository: its packages and the helper scripts in tests/."""
    names = {"aflow_rl", "workers", "train", "tests"}
    for path in _py_files("tests"):
        names.add(os.path.splitext(os.path.basename(path))[0])
    return names


def _imports(path: str) -> list[tuple[str, bool, int]]:
    """(top-level module, imported lazily i.e. inside a function, line) for every absolute import."""
    found: list[tuple[str, bool, int]] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((a.name.split(".")[0], lazy, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module.split(".")[0], lazy, node.lineno))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) \
                and getattr(node.func, "attr", getattr(node.func, "id", None)) in _IMPORT_CALLS:
            found.append((node.args[0].value.split(".")[0], True, node.lineno))
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(open(path).read(), path), False)
    return found


def _third_party(trees) -> list[tuple[str, bool, str]]:
    """(module, lazy, where) for the third-party imports of ``trees``."""
    local = _local_names()
    out = []
    for tree in trees:
        for path in _py_files(tree):
            for mod, lazy, line in _imports(path):
                if mod not in sys.stdlib_module_names and mod not in local and mod not in UNDECLARED_OK:
                    out.append((mod, lazy, f"{os.path.relpath(path, ROOT)}:{line}"))
    return out


def _undeclared(imports, allowed: set[str], allowed_lazy: set[str], where_declared: str) -> list[str]:
    dists = importlib.metadata.packages_distributions()
    problems = []
    for mod, lazy, where in imports:
        names = {_norm(d) for d in dists.get(mod, ())}
        if not names:
            problems.append(f"{where}: imports {mod!r}, which is not installed (declare its distribution in "
                            f"{where_declared})")
        elif not names & (allowed | (allowed_lazy if lazy else set())):
            problems.append(f"{where}: imports {mod!r} from {'/'.join(sorted(names))}, which setup.py does not "
                            f"declare (add it to {where_declared})")
    return sorted(set(problems))


def test_runtime_imports_are_declared():
    base, extras = _declared()
    optional = set().union(*extras.values())
    problems = _undeclared(_third_party(RUNTIME_TREES), base, optional, "install_requires")
    assert not problems, "\n".join(problems)


def test_test_imports_are_declared():
    base, extras = _declared()
    problems = _undeclared(_third_party(TEST_TREES), base | extras["test"], set(), 'extras_require["test"]')
    assert not problems, "\n".join(problems)


def test_declared_dependencies_are_installed():
    base, extras = _declared()
    missing = []
    for name in sorted(base | extras["test"]):
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    assert not missing, f"declared in setup.py but not installed: {missing} (pip install -e '.[test]')"


def test_the_scan_sees_undeclared_imports(tmp_path, monkeypatch):
    # The check itself can fail: a module no distribution provides, and one from an undeclared distribution.
    (tmp_path / "mod.py").write_text("import os\nimport pytest\nimport _no_such_module_\n"
                                     "def f():\n    import yaml\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    imports = _third_party(["mod.py"])
    assert [(m, lazy) for m, lazy, _ in imports] == [("pytest", False), ("_no_such_module_", False), ("yaml", True)]
    problems = _undeclared(imports, {"pytest"}, set(), "install_requires")
    assert len(problems) == 2
    assert "'_no_such_module_', which is not installed" in problems[0]
    assert "'yaml' from pyyaml, which setup.py does not declare" in problems[1]
    assert _undeclared(imports[2:], set(), {"pyyaml"}, "x") == []  # a lazy import may come from an extra


@pytest.mark.parametrize("req,name", [("torch>=2.4", "torch"), ("dask[distributed]>=2024.1", "dask"),
                                      ("reasoning_gym>=0.1", "reasoning-gym"), ("PyYAML", "pyyaml")])
def test_requirement_names(req, name):
    assert _requirement_name(req) == name
