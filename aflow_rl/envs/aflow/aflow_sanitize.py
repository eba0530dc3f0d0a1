"""AFlow's code extraction for HumanEval/MBPP replies (``scripts/utils/sanitize.py``), re-implemented.

AFlow runs a reply through ``sanitize(code, entrypoint)`` before testing it:

1. ``code_extract``: the reply's lines ``i..j`` (``j > i``: at least two lines,
   unless the reply has only one) that parse as Python and hold the most
   non-blank lines; the first such range in ``(i, j)`` order wins, and with no
   parsing range the first line is kept. Prose, fences and trailing chatter fall
   away because they do not parse.
2. ``fallback_sanitize_with_ast``: of that code's top-level statements, keep
   every import, and the function definitions (plain ``def`` only), class
   definitions and assignments to plain names that the entry point reaches
   through the names they mention, each re-printed by ``ast.unparse``, imports
   first, in source order. Anything else at top level (calls, ``if __name__``
   blocks, ``async def``, annotated or tuple assignments) is dropped. If the
   code does not parse, the extracted text is returned unchanged.

AFlow scans every range (quadratic in lines, each a parse); ``code_extract``
here returns the same range but skips ranges that cannot beat the best one
found so far (``tests/envs/aflow/test_scoring_modes.py`` checks it against
the plain scan).
"""
from __future__ import annotations

import ast
import re

_FENCE_LINE = re.compile(r"^\s*```")


def sanitize(text: str, entry_point: str | None) -> str:
    """What AFlow's ``sanitize`` makes of a reply before it is run."""
    code = code_extract(text)
    try:
        return _keep_reachable(code, entry_point)
    except Exception:  # as AFlow: whatever fails here leaves the extracted code as it is
        return code


def defines(code: str, name: str) -> bool:
    """Does ``code`` bind ``name`` at top level (AFlow checks ``entry_point in globals`` after exec)?"""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                (a.asname or a.name.split(".")[0]) == name for a in node.names):
            return True
    return False


# ---------------------------------------------------------------------------
# Step 1: the longest parsing range of lines
# ---------------------------------------------------------------------------


def _parses(lines: list[str], i: int, j: int) -> bool:
    try:
        ast.parse("\n".join(lines[i:j + 1]))
        return True
    except (SyntaxError, MemoryError):  # what AFlow's syntax_check catches; anything else propagates
        return False


def code_extract(text: str) -> str:
    """AFlow's ``code_extract``: the first of the ranges ``i < j`` with the most non-blank lines that parse."""
    lines = text.split("\n")
    n = len(lines)
    # prefix[k]: non-blank lines among lines[:k]; count(i, j) = prefix[j + 1] - prefix[i]
    prefix = [0]
    for line in lines:
        prefix.append(prefix[-1] + (1 if line.strip() else 0))
    best = _fenced_lower_bound(lines, prefix)
    # The best count: for each start, only ends whose range would hold more lines than the best so far.
    for i in range(n):
        for j in range(n - 1, i, -1):
            if prefix[j + 1] - prefix[i] <= best:
                break
            if _parses(lines, i, j):
                best = prefix[j + 1] - prefix[i]
                break
    if best == 0:
        return "\n".join(lines[0:1])
    # AFlow's scan keeps the first range in (i, j) order that reaches the best count.
    for i in range(n):
        for j in range(i + 1, n):
            count = prefix[j + 1] - prefix[i]
            if count > best:
                break
            if count == best and _parses(lines, i, j):
                return "\n".join(lines[i:j + 1])
    raise AssertionError("unreachable: the best count was reached by a parsing range")


def _fenced_lower_bound(lines: list[str], prefix: list[int]) -> int:
    """A count some parsing range reaches: the best fenced block's (it prunes the scan early)."""
    fences = [k for k, line in enumerate(lines) if _FENCE_LINE.match(line)]
    best = 0
    for a, b in zip(fences, fences[1:]):
        i, j = a + 1, b - 1
        if j > i and prefix[j + 1] - prefix[i] > best and _parses(lines, i, j):
            best = prefix[j + 1] - prefix[i]
    return best


# ---------------------------------------------------------------------------
# Step 2: imports and what the entry point reaches
# ---------------------------------------------------------------------------


def _keep_reachable(code: str, entry_point: str | None) -> str:
    tree = ast.parse(code)
    imports: list[str] = []
    definitions: list[tuple[str, str]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append(ast.unparse(node))
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            definitions.append((node.name, ast.unparse(node)))
        elif isinstance(node, ast.Assign):
            # one entry per plain-name target, so "a = b = 1" can appear twice
            definitions.extend((t.id, ast.unparse(node)) for t in node.targets if isinstance(t, ast.Name))
    if not entry_point:
        return "\n".join(imports + [src for _, src in definitions])
    mentions = {name: set() for name, _ in definitions}
    for name, src in definitions:
        mentions[name] |= {n.id for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Name) and n.id in mentions}
    reachable: set[str] = set()
    todo = [entry_point] if entry_point in mentions else []
    while todo:
        name = todo.pop()
        if name not in reachable:
            reachable.add(name)
            todo.extend(mentions[name] - reachable)
    return "\n".join(imports + [src for name, src in definitions if name in reachable])
