"""MATH answers: pull the final answer out of a solution and decide whether two answers are equal.

AFlow scores MATH by extracting the last ``\\boxed{...}`` (else the last
sentence) from both the reference solution and the prediction and calling
them equal when the strings match, when both are numbers within ``1e-3``, or
when sympy finds their difference simplifies to 0. This module keeps the
first two rules and replaces the third with a check that never evaluates
model output as code: both answers are normalised (spacing, ``\\left``/
``\\right``, ``\\dfrac``, units in ``\\text{}``, degrees, percent, dollar
signs, thousands separators, trailing ``.0``, ``x =``), parsed by a small
LaTeX/arithmetic parser (numbers, ``+ - * / ^``, implicit products,
``\\frac``, ``\\sqrt``, ``\\pi``, ``\\infty``, trig/log/exp, ``!``, tuples and
intervals) and compared numerically. Answers with variables are evaluated at a
few fixed random points, so ``(x+1)^2`` equals ``x^2+2x+1``. What the parser
does not understand (sets, matrices, ``\\log_2``, text) is equal only as a
normalised string.
"""
from __future__ import annotations

import math
import random
import re
from decimal import Decimal
from typing import Any

# AFlow's numeric tolerance for MATH answers (math.isclose(..., abs_tol=1e-3)).
ABS_TOL = 1e-3
# Identities in variables must hold tightly at every sample point.
_SYMBOLIC_REL_TOL = 1e-6
_SAMPLE_POINTS = 6
_MAX_ANSWER_CHARS = 400  # longer "answers" are prose; compare them as strings only

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_SENTENCE_END = re.compile(r"(?<!\d)[.!?]\s+")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces) or ``\\boxed x``; None without one."""
    matches = list(_BOXED.finditer(text))
    for m in reversed(matches):
        i = m.end()
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1:j].strip()
            continue  # unbalanced: try an earlier box
        token = re.match(r"[^\s$]+", text[i:])
        if token:
            return token.group(0)
    return None


def extract_answer(text: str) -> str:
    """AFlow's rule: the last boxed answer, else the last sentence of ``text``."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    sentences = [s.strip() for s in _SENTENCE_END.split(text) if s.strip()]
    return sentences[-1] if sentences else ""


# ---------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------

# Spacing commands, but not the "\\\\ " of a matrix row break.
_SPACING = re.compile(r"(?<!\\)\\(?:[,;:! ]|qquad|quad|displaystyle)|~")
_UNIT_TAIL = re.compile(r"^(.+?)\s*\\(?:text|textbf|mbox|mathrm)\{[^{}]*\}$", re.S)
_SCIENTIFIC = re.compile(r"-?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d{1,3}")  # a whole answer only: "2e-1+x" keeps e
_PERCENT_END = re.compile(r"%[\s$]*$")
_TEXT_WRAP = re.compile(r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}")


def normalize(answer: str) -> str:
    """Canonical string of a MATH answer; equal strings are equal answers."""
    s = str(answer).strip().replace("\u2212", "-")
    s = s.strip("$").strip()
    s = _SPACING.sub(" ", s)
    s = re.sub(r"\\left\b|\\right\b", "", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|°", "", s)
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "").replace("$", "")
    # A unit after the value ("5 \text{ cm}") goes; a wholly textual answer ("\text{(A)}") is unwrapped.
    while (m := _UNIT_TAIL.match(s)) and m.group(1).strip():
        s = m.group(1)
    s = _TEXT_WRAP.sub(r"\1", s)
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = s.replace("{,}", "")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)          # \frac12   -> \frac{1}{2}
    s = re.sub(r"\\frac\{([^{}]*)\}(\w)", r"\\frac{\1}{\2}", s)  # \frac{1}2 -> \frac{1}{2}
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)                  # \sqrt2    -> \sqrt{2}
    if s.count("=") == 1 and re.match(r"^[a-zA-Z](_\{?\w+\}?)?=", s):
        s = s.split("=", 1)[1]                                   # "x=5"     -> "5"
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")                                   # 1,000     -> 1000
    if _SCIENTIFIC.fullmatch(s):
        s = format(Decimal(s), "f")                              # 1e3 -> 1000, 5e-05 -> 0.00005
    if re.fullmatch(r"-?\d*\.\d+", s):
        s = s.rstrip("0").rstrip(".") or "0"                     # 5.50 -> 5.5, 5.0 -> 5
        s = re.sub(r"^(-?)\.", r"\g<1>0.", s)                   # .5 -> 0.5
    return s


# ---------------------------------------------------------------------------
# A small parser: normalised answer -> expression tree
# ---------------------------------------------------------------------------

_FUNCS = {"sin": math.sin, "cos": math.cos, "tan": math.tan, "sec": lambda x: 1 / math.cos(x),
          "csc": lambda x: 1 / math.sin(x), "cot": lambda x: 1 / math.tan(x), "arcsin": math.asin,
          "arccos": math.acos, "arctan": math.atan, "ln": math.log, "log": math.log, "exp": math.exp,
          "sqrt": math.sqrt}
_CONSTS = {"pi": math.pi, "infty": math.inf, "inf": math.inf}
_OPS = {"cdot": "*", "times": "*", "div": "/"}
_TOKEN = re.compile(r"\s*(?:(\d+\.?\d*|\.\d+)|\\([a-zA-Z]+)|(sqrt|arcsin|arccos|arctan|sin|cos|tan|log|ln|exp|pi)"
                    r"(?![a-zA-Z])|([a-zA-Z])|(\*\*|[-+*/^(){}\[\],!]))")


class _ParseError(ValueError):
    pass


def _tokenize(s: str) -> list[tuple[str, Any]]:
    tokens, pos = [], 0
    while pos < len(s):
        m = _TOKEN.match(s, pos)
        if not m:
            raise _ParseError(f"unexpected {s[pos:pos + 10]!r}")
        num, cmd, word, letter, op = m.groups()
        if num is not None:
            if math.isinf(float(num)):  # 400 digits are no answer; as inf they would equal each other
                raise _ParseError("number too large")
            tokens.append(("num", float(num)))
        elif cmd is not None or word is not None:
            name = cmd or word
            if name in _OPS:
                tokens.append(("op", _OPS[name]))
            elif name in _CONSTS:
                tokens.append(("num", _CONSTS[name]))
            elif name in _FUNCS or name == "frac":
                tokens.append(("cmd", name))
            else:
                raise _ParseError(f"unknown command \\{name}")
        elif letter is not None:
            tokens.append(("var", letter))
        else:
            tokens.append(("op", "^" if op == "**" else op))
        pos = m.end()
    return tokens


class _Parser:
    """Recursive descent: list := expr (',' expr)* ; expr := term (+|- term)* ; term := factor ((*|/|implicit)
    factor)* ; factor := (+|-) factor | power ; power := postfix (^ factor)? ; postfix := atom '!'*."""

    def __init__(self, tokens):
        self.t, self.i = tokens, 0

    def peek(self):
        return self.t[self.i] if self.i < len(self.t) else (None, None)

    def take(self, value=None):
        tok = self.peek()
        if tok[0] is None or (value is not None and tok[1] != value):
            raise _ParseError(f"expected {value!r}, got {tok[1]!r}")
        self.i += 1
        return tok

    def parse(self):
        items = [self.expr()]
        while self.peek() == ("op", ","):
            self.take()
            items.append(self.expr())
        if self.i != len(self.t):
            raise _ParseError(f"trailing {self.peek()[1]!r}")
        return items[0] if len(items) == 1 else ("list", items)

    def expr(self):
        node = self.term()
        while self.peek() in (("op", "+"), ("op", "-")):
            op = self.take()[1]
            node = ("add" if op == "+" else "sub", node, self.term())
        return node

    def _starts_atom(self) -> bool:
        kind, val = self.peek()
        return kind in ("num", "var", "cmd") or (kind == "op" and val in ("(", "{", "["))

    def term(self):
        node = self.factor()
        while True:
            kind, val = self.peek()
            if kind == "op" and val in ("*", "/"):
                self.take()
                node = ("mul" if val == "*" else "div", node, self.factor())
            elif self._starts_atom():  # implicit product: 2x, 3\sqrt{2}, (x+1)(x-1)
                node = ("mul", node, self.power())
            else:
                return node

    def factor(self):
        if self.peek() in (("op", "-"), ("op", "+")):
            sign = self.take()[1]
            inner = self.factor()
            return ("neg", inner) if sign == "-" else inner
        return self.power()

    def power(self):
        base = self.postfix()
        if self.peek() == ("op", "^"):
            self.take()
            return ("pow", base, self.factor())
        return base

    def postfix(self):
        node = self.atom()
        while self.peek() == ("op", "!"):
            self.take()
            node = ("fact", node)
        return node

    def group(self):
        """A ``{...}`` argument, or a single atom (``\\sqrt x``)."""
        if self.peek() == ("op", "{"):
            self.take()
            node = self.expr()
            self.take("}")
            return node
        return self.atom()

    def atom(self):
        kind, val = self.take()
        if kind == "num":
            return ("num", val)
        if kind == "var":
            return ("var", val)
        if kind == "cmd":
            if val == "frac":
                return ("div", self.group(), self.group())
            if val == "sqrt" and self.peek() == ("op", "["):
                self.take()
                n = self.expr()
                self.take("]")
                return ("pow", self.group(), ("div", ("num", 1.0), n))
            if self.peek() in (("op", "{"), ("op", "(")):  # sin(x)^2 is (sin x)^2; \sin x^2 is sin(x^2)
                return ("fn", val, self.group() if self.peek() == ("op", "{") else self.atom())
            return ("fn", val, self.power())
        if val in ("(", "[", "{"):
            items = [self.expr()]
            while self.peek() == ("op", ","):
                self.take()
                items.append(self.expr())
            close = self.take()[1]
            if close not in (")", "]", "}") or (val == "{") != (close == "}"):
                raise _ParseError(f"bad bracket {close!r}")
            if len(items) == 1 and val + close in ("()", "{}"):
                return items[0]
            return ("tuple", val + close, items)  # (1,2), [0,1), {1,2}
        raise _ParseError(f"unexpected {val!r}")


def parse(answer: str):
    """Expression tree of a normalised answer; raises ValueError when it is not arithmetic."""
    if len(answer) > _MAX_ANSWER_CHARS or not answer:
        raise _ParseError("empty or too long")
    return _Parser(_tokenize(answer)).parse()


def _variables(node, out: set) -> set:
    if node[0] == "var":
        out.add(node[1])
    for child in node[1:]:
        if isinstance(child, tuple):
            _variables(child, out)
        elif isinstance(child, list):
            for c in child:
                _variables(c, out)
    return out


def evaluate(node, env: dict[str, float]) -> float:
    """Value of a scalar tree; raises ArithmeticError/ValueError outside its domain."""
    kind = node[0]
    if kind == "num":
        return node[1]
    if kind == "var":
        return env[node[1]]
    if kind == "neg":
        return -evaluate(node[1], env)
    if kind == "fn":
        return _FUNCS[node[1]](evaluate(node[2], env))
    if kind == "fact":
        x = evaluate(node[1], env)
        if x < 0 or x > 170:
            raise ValueError("factorial out of range")
        return math.gamma(x + 1)
    if kind in ("tuple", "list"):
        raise ValueError("not a scalar")
    a, b = evaluate(node[1], env), evaluate(node[2], env)
    if kind == "add":
        return a + b
    if kind == "sub":
        return a - b
    if kind == "mul":
        return a * b
    if kind == "div":
        return a / b
    value = a ** b  # "pow"; floats overflow with OverflowError instead of building huge integers
    if isinstance(value, complex):
        raise ValueError("complex power")
    return value


# ---------------------------------------------------------------------------
# Equality
# ---------------------------------------------------------------------------


def _scalar_equal(a, b) -> bool:
    names = sorted(_variables(a, set()) | _variables(b, set()))
    if not names:
        try:
            va, vb = evaluate(a, {}), evaluate(b, {})
        except (ArithmeticError, ValueError):
            return False
        return math.isclose(va, vb, abs_tol=ABS_TOL)
    rng = random.Random(0)  # fixed points: the same answers always get the same verdict
    agreed = 0
    for _ in range(_SAMPLE_POINTS):
        env = {n: rng.uniform(0.5, 2.5) for n in names}
        try:
            va = evaluate(a, env)
        except (ArithmeticError, ValueError):
            va = None
        try:
            vb = evaluate(b, env)
        except (ArithmeticError, ValueError):
            vb = None
        if va is None and vb is None:
            continue  # outside both domains: no evidence either way
        if va is None or vb is None or not math.isclose(va, vb, rel_tol=_SYMBOLIC_REL_TOL, abs_tol=1e-9):
            return False
        agreed += 1
    return agreed >= 2


def _trees_equal(a, b) -> bool:
    if a[0] == "tuple" or b[0] == "tuple":
        return (a[0] == b[0] == "tuple" and a[1] == b[1] and len(a[2]) == len(b[2])
                and all(_trees_equal(x, y) for x, y in zip(a[2], b[2])))
    if a[0] == "list" or b[0] == "list":
        # A bare comma list ("all solutions") is unordered: match every item once.
        if not (a[0] == b[0] == "list" and len(a[1]) == len(b[1])):
            return False
        rest = list(b[1])
        for x in a[1]:
            hit = next((k for k, y in enumerate(rest) if _trees_equal(x, y)), None)
            if hit is None:
                return False
            rest.pop(hit)
        return True
    return _scalar_equal(a, b)


def math_equal(prediction: str, reference: str) -> bool:
    """Are two extracted MATH answers equal (normalised strings, else numerically)?

    Percent signs follow ``numbers``' rule: normalising drops them, and a
    reference written ``p%`` is also matched by ``p/100`` when the prediction
    has no percent sign."""
    p, r = normalize(prediction), normalize(reference)
    if _normalized_equal(p, r):
        return True
    if _PERCENT_END.search(str(reference)) and not _PERCENT_END.search(str(prediction)):
        return _normalized_equal(p, f"\\frac{{{r}}}{{100}}")
    return False


def _normalized_equal(p: str, r: str) -> bool:
    if p == r:
        return bool(p)
    try:
        tp, tr = parse(p), parse(r)
    except (ValueError, IndexError):
        return False
    return _trees_equal(tp, tr)
