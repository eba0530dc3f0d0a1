"""Issue 8 (3) and (4): one rule for numbers, reference answers kept as written, and the two scoring modes
(``default`` and ``aflow``) pinned on the same inputs.

The ``aflow`` expectations follow AFlow's ``benchmarks/`` code (FoundationAgents/AFlow); each case names the
function it follows. They were also checked by running AFlow's own functions on every case (see the report
of the change); the tests here need no copy of AFlow.
"""
import asyncio
import json
import re
from fractions import Fraction

import pytest

from aflow_rl.envs.aflow import aflow_reference
from aflow_rl.envs.aflow.aflow_sanitize import code_extract, defines, sanitize
from aflow_rl.envs.aflow.datasets import Problem, load_dataset
from aflow_rl.envs.aflow.math_equiv import math_equal
from aflow_rl.envs.aflow.numbers import answer_number, find_numbers, numbers_equal
from aflow_rl.envs.aflow.scoring import score


def _jsonl(tmp_path, rows):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


# ---------------------------------------------------------------------------
# (3) The number rule (numbers.py docstring), one fixture per clause
# ---------------------------------------------------------------------------

F = Fraction


@pytest.mark.parametrize("text, values", [
    ("0.00005", [F(1, 20000)]),                      # decimals are exact, no float round trip
    ("5e-05", [F(1, 20000)]),                        # exponent: the same number
    ("1e3 and 2.5E+3", [F(1000), F(2500)]),          # exponent with and without sign
    ("1e99999", [F(1), F(99999)]),                   # five exponent digits are no exponent
    ("1,234,567", [F(1234567)]),                     # thousands separators
    ("1,23", [F(1), F(23)]),                         # a comma not before three digits separates
    ("1,2345", [F(1), F(2345)]),
    ("1234,567", [F(1234), F(567)]),                 # first group longer than three: not a separator
    ("x = -5", [F(-5)]),                             # sign after "="
    ("(-5)", [F(-5)]),
    ("3-5", [F(3), F(5)]),                           # a minus between two numbers is no sign
    ("x-5", [F(5)]),                                 # ...nor after a letter
    ("2023-10-05", [F(2023), F(10), F(5)]),
    ("\u22127", [F(-7)]),                            # Unicode minus
    ("-$5 and $1,000.50", [F(-5), F(2001, 2)]),  # currency between sign and digits
    ("3/4.", [F(3, 4)]),                             # a fraction of integers
    ("-1/2", [F(-1, 2)]),
    ("10/05/2023", [F(10), F(5), F(2023)]),          # a chain of slashes is no fraction
    ("1/0", [F(1), F(0)]),                           # nor a zero denominator
    ("\\frac{3}{4}", [F(3, 4)]),                     # LaTeX fractions
    ("\\dfrac{-1}{2}", [F(-1, 2)]),
    ("-\\frac{3}{4}", [F(-3, 4)]),
    (".5 and 5.", [F(1, 2), F(5)]),                  # a leading dot; a trailing one ends the sentence
    ("9" * 5000, []),                                # beyond Python's digit limit: not a number
])
def test_find_numbers_values(text, values):
    assert [n.value for n in find_numbers(text)] == values


def only_number(text):
    """The one number in ``text``, read by find_numbers (the scorer's own reader)."""
    (n,) = find_numbers(text)
    return n


@pytest.mark.parametrize("text, value, percent", [
    ("50%", F(50), True), ("50\\%", F(50), True), ("50 %", F(50), True), ("0.5", F(1, 2), False),
])
def test_percent_is_marked_not_applied(text, value, percent):
    n = only_number(text)
    assert (n.value, n.percent) == (value, percent)


@pytest.mark.parametrize("text, value", [
    ("The answer is \\boxed{18}. Check: 3 bags", F(18)),   # last number in the last box
    ("\\boxed{x} so 7", F(7)),                            # a box without a number: fall back
    ("steps 1, 2\n#### 72 apples, 3 days", F(72)),        # first number after the last ####
    ("18 or 19", F(19)),                                  # else the last number
    ("no number", None),
])
def test_answer_number(text, value):
    n = answer_number(text)
    assert (n.value if n else None) == value


@pytest.mark.parametrize("pred, ref, equal", [
    ("0.00005", "0.00005", True), ("5e-5", "0.00005", True), ("1e3", "1000", True),
    ("0.0000505", "0.00005", False),   # 1% off: the tolerance is relative below 1
    ("18.0000001", "18", True),        # |diff| 1e-7 <= 1e-6
    ("18.00001", "18", False),         # |diff| 1e-5
    ("0.0000001", "0", False),         # zero only equals zero
    ("50", "50%", True), ("0.5", "50%", True), ("50%", "50%", True),  # a percent reference: p, p/100, p%
    ("25%", "25", True),               # a percent prediction against a plain reference: sign dropped
    ("25%", "0.25", False),            # ...so it cannot hedge between 25 and 0.25
    ("3/4", "0.75", True), ("-1/2", "-0.5", True), ("1,000", "1000", True),
])
def test_numbers_equal(pred, ref, equal):
    assert numbers_equal(only_number(pred), only_number(ref)) is equal


def test_gsm8k_reference_kept_as_written(tmp_path):
    rows = [{"question": "q", "answer": "5 / 100000 = 0.00005\n#### 0.00005"},
            {"question": "q", "answer": "1000 + 234\n#### 1,234"},
            {"question": "q", "answer": "So the answer is 42."},   # no ####: the answer number's text
            {"question": "q", "answer": 5e-05},                    # a JSON number: its repr, read by the rule
            {"question": "q", "answer": "#### 72 in total, 3 days"},  # the number after ####, not the last
            {"question": "q", "answer": "#### eighteen"}]          # no number: the text after ####
    problems = load_dataset(f"gsm8k:{_jsonl(tmp_path, rows)}")
    assert [p.answer for p in problems] == ["0.00005", "1,234", "42", "5e-05", "72", "eighteen"]
    assert problems[0].metadata["solution"] == rows[0]["answer"]
    assert score(problems[0], "0.00005") == 1.0 and score(problems[3], "The answer is 0.00005") == 1.0
    assert score(problems[1], "1234") == 1.0 and score(problems[4], "72") == 1.0
    assert score(problems[5], "18") == 0.0 and score(problems[5], "eighteen") == 0.0


@pytest.mark.parametrize("pred, ref, equal", [
    ("1e3", "1000", True), ("5e-05", "0.00005", True),   # a whole answer in scientific notation
    ("2e-1+x", "x+0.2", False),                          # inside an expression e stays a variable
    ("\u22123", "-3", True),                             # Unicode minus
    ("0.5", "50\\%", True), ("50", "50\\%", True),       # percent: the reference decides
    ("50\\%", "0.5", False), ("50\\%", "50", True),
    ("10^{400}", "10^{401}", False), ("1" + "0" * 400, "1" + "0" * 401, False),  # no equal infinities
])
def test_math_default_number_rule(pred, ref, equal):
    assert math_equal(pred, ref) is equal


# ---------------------------------------------------------------------------
# (4) Both modes on the same inputs
# ---------------------------------------------------------------------------

HE_ROW = {"task_id": "HE/sq", "prompt": "def sq(x):\n    \"\"\"Square x.\"\"\"\n", "entry_point": "sq",
          "canonical_solution": "    return x * x\n", "test": "def check(candidate):\n    assert candidate(3) == 9\n"}
MBPP_ROW = {"task_id": 2, "prompt": "Write a function to add two numbers.", "entry_point": "add_nums",
            "code": "def add_nums(a, b):\n    return a + b", "test_imports": [],
            "test": "def check():\n    assert add_nums(1, 2) == 3\n"}

# (dataset, reference, prediction, default verdict, aflow verdict). The comment names the AFlow function.
CASES = [
    # GSM8K: GSM8KBenchmark.extract_number on the full answer and on the prediction, calculate_score (1e-6)
    ("gsm8k", "5/100000 = 0.00005\n#### 0.00005", "0.00005", 1, 1),       # extract_number: 0.00005
    ("gsm8k", "5/100000 = 0.00005\n#### 0.00005", "5e-05", 1, 0),         # extract_number: "-05" -> -5
    ("gsm8k", "5/100000 = 0.00005\n#### 0.00005", "0.0000505", 0, 1),     # calculate_score: |d| 5e-7 <= 1e-6
    ("gsm8k", "10**3\n#### 1000", "1e3", 1, 0),                           # extract_number: "3"
    ("gsm8k", "#### 1000", "1,000", 1, 1),                                # extract_number drops commas
    ("gsm8k", "#### 1234", "1,234.0", 1, 1),
    ("gsm8k", "#### 1000000", "1,000,000", 1, 1),
    ("gsm8k", "#### -3", "It is -3 degrees", 1, 1),
    ("gsm8k", "#### -18", "\u221218", 1, 0),                              # no Unicode minus: 18
    ("gsm8k", "#### 5", "The range is 3-5", 1, 0),                        # extract_number: "-5"
    ("gsm8k", "#### 25", "The discount is 25%.", 1, 1),                   # "%" ignored: 25
    ("gsm8k", "#### 0.25", "25%", 0, 0),                                  # 25 != 0.25
    ("gsm8k", "#### 50%", "0.5", 1, 0),                                   # reference 50
    ("gsm8k", "#### 50%", "50", 1, 1),
    ("gsm8k", "#### 0.75", "3/4", 1, 0),                                  # extract_number: "4"
    ("gsm8k", "#### 18", "\\boxed{18}. Check: 3 bags", 1, 0),             # the last number, 3
    ("gsm8k", "#### 18", "18 or 19", 0, 0),
    ("gsm8k", "#### 18", "no idea", 0, 0),                                # None prediction scores 0
    ("gsm8k", "#### 18", "18.0000001", 1, 1),
    ("gsm8k", "#### 7", "$7.00", 1, 1),
    ("gsm8k", "The answer is eighteen.", "18", 0, 0),                     # no reference number: 0
    ("gsm8k", "#### 1234567", "1234,567", 0, 1),                          # its pattern: any leading group
    ("gsm8k", "#### 72 in total, 3 days", "72", 1, 0),                    # the last number of the answer: 3
    ("gsm8k", "#### 0.75", "\\frac{3}{4}", 1, 0),
    # MATH: MATHBenchmark.extract_model_answer on both texts, math_equal (parse_digits, symbolic_equal)
    ("math", "$\\boxed{\\frac{1}{2}}$", "\\boxed{0.5}", 1, 0),            # symbolic_equal: no LaTeX parser
    ("math", "The height is $\\boxed{\\frac{\\sqrt{3}}{2}}$.", "\\boxed{\\frac{\\sqrt{3}}{2}}", 1, 0),
    # ^ extract_model_answer: two nesting levels defeat its box pattern, the whole last sentence is compared
    ("math", "\\boxed{0.75}", "\\boxed{0.7505}", 1, 1),                   # parse_digits + isclose(1e-3)
    ("math", "\\boxed{0.75}", "\\boxed{0.752}", 0, 0),
    ("math", "\\boxed{50\\%}", "\\boxed{0.5}", 1, 1),                     # parse_digits: "50\%" -> 0.5
    ("math", "\\boxed{0.5}", "\\boxed{50\\%}", 0, 1),
    ("math", "\\boxed{50\\%}", "\\boxed{50}", 1, 0),                      # 0.5 vs 50, decided without sympy
    ("math", "\\boxed{1000}", "\\boxed{1e3}", 1, 1),                      # parse_digits: float("1e3")
    ("math", "\\boxed{1,000}", "\\boxed{1000}", 1, 1),                    # parse_digits drops commas
    ("math", "\\boxed{12}", "\\boxed{1,2}", 0, 1),                        # ...every comma
    ("math", "\\boxed{x^2+2x+1}", "\\boxed{(x+1)^2}", 1, 0),              # parse_expr: "2x" is no syntax
    ("math", "\\boxed{x**2+2*x+1}", "\\boxed{(x+1)**2}", 1, 1),           # symbolic_equal: simplify(a-b)==0
    ("math", "\\boxed{-3}", "\\boxed{\u22123}", 1, 0),
    ("math", "\\boxed{5}", "\\boxed{5 \\text{ cm}}", 1, 0),
    ("math", "\\boxed{30^\\circ}", "\\boxed{30}", 1, 0),
    ("math", "\\boxed{\\pi}", "\\boxed{2\\pi}", 0, 0),
    ("math", "\\boxed{3}", "The answer is 3", 0, 0),                      # last sentence, not a number
    ("math", "\\boxed{3}", "First \\boxed{2}, then \\boxed{3}", 1, 1),    # the last box
    ("math", "\\boxed{\\sqrt{2}}", "\\boxed{sqrt(2)}", 1, 0),
    ("math", "\\boxed{2}", "\\boxed{2.0}", 1, 1),
    ("math", "\\boxed{\\frac{1}{2}}", "\\boxed{1/2}", 1, 0),
    ("math", "\\boxed{2\\sqrt{2}}", "\\boxed{\\sqrt{8}}", 1, 0),
    ("math", "\\boxed{(1,2)}", "\\boxed{(1, 2)}", 1, 0),                  # N() of a tuple: isclose raises
    ("math", "\\boxed{2.71828}", "\\boxed{E}", 0, 1),                     # sympy's E; N(E) within 1e-3
    ("math", "\\boxed{8}", "\\boxed{2^3}", 1, 0),                         # parse_expr: ^ is XOR
    ("math", "\\boxed{\\text{(A)}}", "\\boxed{(A)}", 1, 0),
    ("math", "\\boxed{5}", "\\boxed{x = 5}", 1, 0),                       # parse_expr: "=" is no syntax
    ("math", "\\boxed{7}", "The answer is $\\boxed 7$", 1, 0),            # only "\\boxed{" is a box
    ("math", "\\boxed{0.3333}", "\\boxed{Rational(1,3)}", 0, 1),          # sympy names: N() within 1e-3
    ("math", "\\boxed{1}", "\\boxed{sin(x)**2+cos(x)**2}", 1, 1),         # symbolic_equal: simplify
    ("math", "\\boxed{1}", "\\boxed{__import__('os').getpid() and 1}", 0, 0),
    # ^ the one departure: AFlow's parse_expr would run this (and score 1); the gate refuses it
    # HotpotQA: HotpotQABenchmark.calculate_score (token F1 of normalize_answer)
    ("hotpotqa", "the Eiffel Tower", "Eiffel Tower in Paris!", 2 / 3, 2 / 3),
    ("hotpotqa", "the Eiffel Tower", "An EIFFEL tower.", 1, 1),
    ("hotpotqa", "the Eiffel Tower", "London", 0, 0),
    ("hotpotqa", "the Eiffel Tower", "", 0, 0),
    ("hotpotqa", "1,000", "1000", 1, 1),                                  # punctuation removed
    ("hotpotqa", "the", "the", 0, 0),                                     # both normalise to nothing
    ("hotpotqa", "Barack Obama", "Obama, Barack", 1, 1),                  # a bag of tokens
    # DROP: DROPBenchmark.evaluate_problem (max F1 over "|" answers and "|" prediction parts)
    ("drop", "4|four", "4", 1, 1),
    ("drop", "4|four", "Four.", 1, 1),
    ("drop", "4|four", "about 4 yards", 0.5, 0.5),
    ("drop", "4|four", "5|four", 1, 1),
    ("drop", "John Smith|Smith", "John", 2 / 3, 2 / 3),
    ("drop", "|", "x", 0, 0),                                             # max() of nothing: the error path
    ("drop", "12.5", "125", 1, 1),                                        # "12.5" normalises to "125"
    ("drop", "12.5", "12.5 points", 2 / 3, 2 / 3),
    # HumanEval: HumanEvalBenchmark.check_solution after sanitize (code_extract + AST filter)
    ("humaneval", "sq", "    return x * x\n", 1, 0),                      # no def: "not defined" in AFlow
    ("humaneval", "sq", "Here you go:\n```python\ndef sq(x):\n    return x * x\n```\nHope it helps.", 1, 1),
    ("humaneval", "sq", "def sq(x):\n    return int(math.pow(x, 2))", 0, 1),  # math is preloaded in AFlow
    ("humaneval", "sq", "def sq(x):\n    return x * x\n\nassert False", 0, 1),  # top-level code dropped
    ("humaneval", "sq", "def sq(x):\n    return x + x", 0, 0),
    # MBPP: MBPPBenchmark.check_solution after sanitize
    ("mbpp", "add", "```python\ndef add_nums(a, b):\n    return a + b\n```", 1, 1),
    ("mbpp", "add", "def add_nums(a, b):\n    return a - b", 0, 0),
    ("mbpp", "add", "def add_nums(a, b):\n    return int(re.sub('x', '', str(a + b)))", 0, 1),  # re preloaded
    ("mbpp", "add", "Sure! Here it is:\ndef add_nums(a, b):\n    return a + b\nThis adds them.", 0, 1),
    # ^ code_extract keeps the two lines that parse; the default mode runs the whole unfenced reply
    ("mbpp", "add", "def add_nums(a, b):\n    return a + b + OFFSET\n\nOFFSET, _ = 0, 0", 1, 0),
    # ^ fallback_sanitize_with_ast keeps assignments to plain names only: OFFSET is undefined
]


def _case_problem(tmp_path, dataset: str, reference: str) -> Problem:
    row = {"gsm8k": lambda: {"question": "q", "answer": reference},
           "math": lambda: {"problem": "q", "solution": reference},
           "hotpotqa": lambda: {"question": "q", "answer": reference, "context": []},
           "drop": lambda: {"context": "q", "ref_text": reference},
           "humaneval": lambda: HE_ROW, "mbpp": lambda: MBPP_ROW}[dataset]()
    [problem] = load_dataset(f"{dataset}:{_jsonl(tmp_path, [row])}")
    return problem


def test_case_table_covers_every_dataset():
    assert len(CASES) >= 60
    assert {c[0] for c in CASES} == {"gsm8k", "math", "hotpotqa", "drop", "humaneval", "mbpp"}
    assert all(any(c[0] == d and c[3] != c[4] for c in CASES) for d in ("gsm8k", "math", "humaneval", "mbpp"))


@pytest.mark.parametrize("dataset, reference, prediction, default, aflow", CASES)
def test_both_modes_on_the_same_input(tmp_path, dataset, reference, prediction, default, aflow):
    problem = _case_problem(tmp_path, dataset, reference)
    assert score(problem, prediction) == pytest.approx(default)
    assert score(problem, prediction, mode="aflow") == pytest.approx(aflow)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="unknown scoring mode 'exact': use one of default, aflow"):
        score(Problem("p", "gsm8k", "q", "1"), "1", mode="exact")


def test_aflow_math_never_runs_model_text(tmp_path):
    marker = tmp_path / "pwned"
    problem = Problem("m", "math", "q", "1", {"solution": "\\boxed{1}"})
    for attack in (f"__import__('os').system('touch {marker}')", f"open('{marker}', 'w')",
                   f"sympify(\"__import__('os').system('touch {marker}')\")", "().__class__.__base__"):
        assert score(problem, f"\\boxed{{{attack}}}", mode="aflow") == 0.0
    assert not marker.exists()


def test_aflow_gsm8k_reads_the_full_answer_text():
    # AFlow's expected value is extract_number(problem["answer"]): the last number of the whole solution.
    p = Problem("g", "gsm8k", "q", "18", {"solution": "3 * 6 = 18\n#### 18"})
    assert score(p, "18", mode="aflow") == 1.0
    bare = Problem("g", "gsm8k", "q", "5e-05")  # no solution kept: the stored answer, read AFlow's way (-5)
    assert score(bare, "-5", mode="aflow") == 1.0 and score(bare, "0.00005", mode="aflow") == 0.0


# ---------------------------------------------------------------------------
# AFlow's sanitize
# ---------------------------------------------------------------------------


def _plain_scan(text: str) -> str:
    """AFlow's code_extract as its loop reads (every range i < j, first strictly longest): the reference
    the pruned search must agree with."""
    import ast

    lines = text.split("\n")
    best, pair = 0, (0, 0)
    for i in range(len(lines)):
        for j in range(i + 1, len(lines)):
            chunk = "\n".join(lines[i:j + 1])
            try:
                ast.parse(chunk)
            except (SyntaxError, MemoryError):
                continue
            count = sum(1 for line in lines[i:j + 1] if line.strip())
            if count > best:
                best, pair = count, (i, j)
    return "\n".join(lines[pair[0]:pair[1] + 1])


EXTRACT_TEXTS = [
    "def f(x):\n    return x",
    "one line only",
    "x = 1",
    "Here:\n```python\ndef f(x):\n    return x\n```\nAnd a note.\n```\nprint(1)\n```",
    "prose\n\n\ndef f():\n    pass\n\n\nmore prose: not code",
    "a = 1\nb = 2\nnot python here\nc = 3\nd = 4\ne = 5",
    "\n\n\n",
    "    indented\n    return 1\n",
    "if x:\n    y = 1\nelse\n    y = 2\nz = 3\nw = 4",
    "```\n```\n```python\nx = [\n```\n]\n",
    "def f():\n    '''doc\n\nstill doc'''\n    return 1\n\nThat's it.",
]


@pytest.mark.parametrize("text", EXTRACT_TEXTS)
def test_code_extract_matches_the_plain_scan(text):
    assert code_extract(text) == _plain_scan(text)


def test_sanitize_keeps_imports_and_what_the_entry_point_reaches():
    reply = ("Sure:\n```python\nimport math\nfrom typing import List\n\nSCALE = 2\nUNUSED = 3\n\n"
             "def helper(x):\n    return x * SCALE\n\ndef other():\n    return 0\n\n"
             "async def f_async():\n    pass\n\na, b = 1, 2\n\nclass K:\n    pass\n\n"
             "def solve(x: List[int]) -> int:\n    # comment dropped by unparse\n    return helper(math.floor(x))\n\n"
             "print(solve(3))\n```\nDone.")
    out = sanitize(reply, "solve")
    assert out.splitlines()[:2] == ["import math", "from typing import List"]
    assert "SCALE = 2" in out and "def helper(x):" in out and "def solve(x: List[int]) -> int:" in out
    for dropped in ("UNUSED", "def other", "async def", "a, b", "class K", "print(", "comment"):
        assert dropped not in out
    assert defines(out, "solve") and not defines(out, "other")
    assert aflow_reference.code_to_run("    return 1", "solve") is None       # body only: AFlow fails it
    assert aflow_reference.code_to_run(reply, "solve").startswith(aflow_reference.CODE_PRELUDE)


# ---------------------------------------------------------------------------
# The mode reaches the evaluator from the config
# ---------------------------------------------------------------------------


def test_config_mode_reaches_the_scorer():
    from aflow_rl.config import ConfigError, load_config
    from aflow_rl.envs.aflow.graph import Node, Workflow
    from aflow_rl.envs.aflow.optimizer import make_evaluate
    from tests.envs.aflow.test_evaluator import ScriptedExecutor

    problems = [Problem("g", "gsm8k", "q", "0.00005", {"solution": "#### 0.00005"})]
    llm = ScriptedExecutor(lambda prompt: "<answer>5e-05</answer>")
    workflow = Workflow(nodes=[Node("a", "AnswerGenerate", {}, [])], output="a")
    scores = {}
    for mode in ("default", "aflow"):
        cfg = load_config(None, [f"env.aflow.scoring={mode}"]).env.aflow
        scores[mode] = asyncio.run(make_evaluate(cfg, llm, problems)(workflow)).score
    assert scores == {"default": 1.0, "aflow": 0.0}  # AFlow reads 5e-05 as -5
    assert load_config(None, []).env.aflow.scoring == "default"
    with pytest.raises(ConfigError, match=re.escape("env.aflow.scoring: expected one of 'default' | 'aflow'")):
        load_config(None, ["env.aflow.scoring=exact"])
