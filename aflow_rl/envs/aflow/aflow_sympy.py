"""AFlow's sympy step for MATH (``MATHBenchmark.symbolic_equal``), run where model text cannot hurt.

AFlow's last resort for two MATH answers: each is parsed with sympy's
``parse_latex``, else ``parse_expr``, else kept as a string; they are equal
when ``simplify(a - b) == 0`` or when ``N(a)`` and ``N(b)`` are within
``abs_tol=1e-3``, every exception counting as "not equal". In AFlow's pinned
environment (``requirements.txt``: sympy 1.14.0 and no
``antlr4-python3-runtime``; this project's has antlr4 4.13, which sympy also
refuses) ``parse_latex`` always raises ImportError, so ``parse_expr`` decides
every case, and that is what runs here.

``parse_expr`` ends in ``eval`` and ``N`` of a string calls it again through
``sympify``: model text would run as Python. So the check runs in the
sandbox (``aflow_rl.sandbox.run_python``: a fresh process, rlimits, a wall
clock; simplify of a large power can otherwise run for ever) and, inside it,
every expression sympy is about to ``eval`` passes a gate first: its syntax
tree may hold only literals, arithmetic, comparisons, calls, indexing and
containers, and names of sympy's classes and constants, a few sympy functions
and pure numeric builtins. Attribute access, names starting with ``_``,
lambdas, comprehensions and every other name are refused, which sympy then
reports as a parse error. That is the one place this check departs from
AFlow: an answer whose evaluation would reach past sympy's arithmetic (e.g.
``__import__('os')``) counts as unparseable instead of being run. With the
gate the code cannot print or learn the per-run nonce that marks the verdict
line either.

If the sandbox times out or runs out of memory the verdict is "not equal"
(AFlow would still be waiting); a sandbox that cannot start raises
RuntimeError.
"""
from __future__ import annotations

import functools
import json
import logging
import secrets

log = logging.getLogger(__name__)

SYMPY_TIMEOUT_S = 20.0
SYMPY_MEMORY_MB = 1024

# Runs as the sandbox's main script; the two answers and the nonce come on stdin, never in the code.
_SCRIPT = r'''
import ast, json, math, sys
job = json.loads(sys.stdin.read())
nonce, pairs = job["nonce"], job["pairs"]
del job

import builtins
import sympy
from sympy import N, simplify
from sympy.parsing import sympy_parser

SAFE_FUNCTIONS = {
    "sqrt", "cbrt", "root", "real_root", "simplify", "expand", "factor", "together", "cancel", "apart",
    "gcd", "lcm", "igcd", "ilcm", "symbols", "nsimplify", "Matrix", "ImmutableMatrix", "Abs", "N",
    "sympify", "S", "parse_expr",  # strings they parse come back through this gate
}
SAFE_BUILTINS = {"abs", "pow", "round", "divmod"}
NODES = (ast.Expression, ast.Constant, ast.Name, ast.Load, ast.Call, ast.keyword, ast.BinOp, ast.UnaryOp,
         ast.BoolOp, ast.Compare, ast.operator, ast.unaryop, ast.boolop, ast.cmpop, ast.Tuple, ast.List,
         ast.Set, ast.Dict, ast.Subscript, ast.Slice, ast.IfExp)


def safe_name(name, local_dict, global_dict):
    if name.startswith("_"):
        return False
    if name in local_dict:
        obj = local_dict[name]
    elif name in global_dict:
        obj = global_dict[name]
    else:
        return False  # it would come from builtins
    if getattr(builtins, name, None) is obj:
        return name in SAFE_BUILTINS
    if isinstance(obj, type):
        return issubclass(obj, sympy.Basic) or name in SAFE_FUNCTIONS
    return isinstance(obj, sympy.Basic) or (name in SAFE_FUNCTIONS and getattr(sympy, name, None) is obj)


def check(code, local_dict, global_dict):
    if not isinstance(code, str):
        raise ValueError("refused: compiled code")
    try:
        tree = ast.parse(code.strip(), mode="eval")
    except SyntaxError:
        return  # eval raises the same SyntaxError without running anything
    for node in ast.walk(tree):
        if not isinstance(node, NODES):
            raise ValueError("refused: " + type(node).__name__)
        if isinstance(node, ast.Name) and not safe_name(node.id, local_dict, global_dict):
            raise ValueError("refused name: " + node.id)
        if isinstance(node, ast.keyword) and (node.arg is None or node.arg.startswith("_")):
            raise ValueError("refused keyword")


_eval_expr = sympy_parser.eval_expr


def gated_eval_expr(code, local_dict, global_dict):
    check(code, local_dict, global_dict)
    return _eval_expr(code, local_dict, global_dict)


sympy_parser.eval_expr = gated_eval_expr


def parse(s):
    # parse_latex first, as AFlow; it raises ImportError in AFlow's environment (no antlr4 4.11)
    try:
        return sympy_parser.parse_expr(s)
    except BaseException:
        return s


def symbolic_equal(a, b):
    a, b = parse(a), parse(b)
    try:
        if simplify(a - b) == 0:
            return True
    except BaseException:
        pass
    try:
        if math.isclose(N(a), N(b), abs_tol=1e-3):
            return True
    except BaseException:
        pass
    return False


verdicts = [symbolic_equal(a, b) for a, b in pairs]
sys.stdout.write("\n" + nonce + " " + json.dumps(verdicts) + "\n")
'''


@functools.lru_cache(maxsize=4096)
def symbolic_equal(prediction: str, reference: str) -> bool:
    """AFlow's ``symbolic_equal(prediction, reference)``, sandboxed and gated (module docstring)."""
    return symbolic_equal_many([(prediction, reference)])[0]


def symbolic_equal_many(pairs: list[tuple[str, str]]) -> list[bool]:
    """``symbolic_equal`` for several pairs in one sandbox run (one sympy import)."""
    from aflow_rl.sandbox import run_python

    if not pairs:
        return []
    nonce = secrets.token_hex(16)
    stdin = json.dumps({"nonce": nonce, "pairs": [[str(a), str(b)] for a, b in pairs]})
    res = run_python(_SCRIPT, timeout_s=SYMPY_TIMEOUT_S * len(pairs), memory_mb=SYMPY_MEMORY_MB, stdin=stdin)
    for line in reversed(res.stdout.splitlines()):
        if line.startswith(nonce + " "):
            verdicts = json.loads(line[len(nonce) + 1:])
            if isinstance(verdicts, list) and len(verdicts) == len(pairs):
                return [v is True for v in verdicts]
    if res.timed_out or "memory" in res.error:
        if len(pairs) > 1:  # one pathological pair must not cost the others their verdicts
            return [v for pair in pairs for v in symbolic_equal_many([pair])]
        log.warning("AFlow symbolic check gave no verdict (%s): counted as not equal", res.error or "timeout")
        return [False]
    raise RuntimeError(f"AFlow symbolic check failed in the sandbox: {res.error or res.stderr[-300:]}")
