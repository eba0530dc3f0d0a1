"""The tools the orchestrator and its subagents may call: ``lookup`` and ``calc``.

Both are pure functions of their arguments and the knowledge base, so a tool
call never depends on the network, the clock or the call order. A bad call
(unknown entity, malformed expression) is an outcome the caller sees, never
an exception that ends an episode.
"""
from __future__ import annotations

import ast
import operator
from dataclasses import dataclass

from aflow_rl.envs.swarm.kb import KnowledgeBase

# tool -> required string arguments (the action schema and the validator both read this).
TOOLS: dict[str, tuple[str, ...]] = {"lookup": ("entity", "attribute"), "calc": ("expr",)}
TOOL_HELP = {
    "lookup": "lookup(entity, attribute): one fact of the knowledge base",
    "calc": "calc(expr): integer arithmetic with + - * / // % and parentheses",
}

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPR_CHARS = 200
_MAX_ABS = 10 ** 15  # keeps a hostile expression from building huge integers


@dataclass(frozen=True)
class ToolResult:
    ok: bool
    value: str = ""
    error: str = ""

    def text(self) -> str:
        return self.value if self.ok else f"error: {self.error}"


def format_number(x: float | int) -> str:
    """Integers print without a decimal point; other floats keep up to 6 significant decimals."""
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    return str(x) if isinstance(x, int) else f"{x:.6g}"


def calc(expr: str) -> str:
    """Evaluate an arithmetic expression without ``eval`` (an AST walk over numbers and + - * / // %)."""
    if len(expr) > _MAX_EXPR_CHARS:
        raise ValueError(f"expression longer than {_MAX_EXPR_CHARS} characters")
    tree = ast.parse(expr.replace(",", ""), mode="eval")

    def ev(node: ast.AST) -> float | int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            out = _BINOPS[type(node.op)](ev(node.left), ev(node.right))
            if abs(out) > _MAX_ABS:
                raise ValueError("result too large")
            return out
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported syntax: {ast.dump(node)[:40]}")

    return format_number(ev(tree))


def call_tool(kb: KnowledgeBase, tool: str, args: dict) -> ToolResult:
    """Run one tool call; every failure comes back as ``ToolResult(ok=False, error=...)``."""
    if tool not in TOOLS:
        return ToolResult(False, error=f"unknown tool {tool!r}; tools: {', '.join(TOOLS)}")
    missing = [a for a in TOOLS[tool] if not isinstance(args.get(a), str) or not args.get(a)]
    if missing:
        return ToolResult(False, error=f"{tool} needs string argument(s) {', '.join(missing)}")
    try:
        if tool == "lookup":
            return ToolResult(True, kb.lookup(args["entity"], args["attribute"]))
        return ToolResult(True, calc(args["expr"]))
    except KeyError as exc:
        return ToolResult(False, error=str(exc.args[0]) if exc.args else "not found")
    except (ValueError, SyntaxError, ZeroDivisionError, TypeError, OverflowError, RecursionError) as exc:
        return ToolResult(False, error=f"{type(exc).__name__}: {exc}")
