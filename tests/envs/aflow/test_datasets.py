"""AFlow datasets and scorers on small hand-written fixtures (and the bundled HumanEval)."""
import dataclasses
import json
import math
import os

import pytest

from aflow_rl.envs.aflow.datasets import Problem, load_dataset, split
from aflow_rl.envs.aflow.math_equiv import extract_boxed, math_equal
from aflow_rl.envs.aflow.scoring import drop_f1, f1, judge_parts, score


def _jsonl(tmp_path, name, rows):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


# ---------------------------------------------------------------------------
# GSM8K
# ---------------------------------------------------------------------------

GSM8K_ROWS = [
    {"question": "Tom has 3 bags of 6 apples. How many apples?", "answer": "3 * 6 = 18\n#### 18"},
    {"question": "A car costs $1,000 plus $234 tax. Total?", "answer": "1000 + 234 = 1234\n#### 1,234"},
    {"question": "Half of 5?", "answer": "5 / 2 = 2.5\n#### 2.5"},
]


def test_gsm8k_loads_reference_number(tmp_path):
    problems = load_dataset(f"gsm8k:{_jsonl(tmp_path, 'gsm8k.jsonl', GSM8K_ROWS)}")
    assert [p.answer for p in problems] == ["18", "1,234", "2.5"]  # as written after "####" (issue 8)
    assert problems[0].question == GSM8K_ROWS[0]["question"] and problems[0].kind == "gsm8k"
    assert problems[0].id == "gsm8k/0"


@pytest.mark.parametrize("prediction, expected", [
    ("3 bags times 6 is 18 apples. The answer is 18.", 1.0),
    ("The total is $1,234", None),  # scored against the second problem below
    ("18.0000001", 1.0),            # |diff| = 1e-7 <= 1e-6
    ("18.00001", 0.0),              # |diff| = 1e-5 > 1e-6
    ("I think 17, no wait, 18 or 19", 0.0),  # the *last* number counts
    ("no idea", 0.0),
])
def test_gsm8k_score_numeric_tolerance(tmp_path, prediction, expected):
    problems = load_dataset(f"gsm8k:{_jsonl(tmp_path, 'gsm8k.jsonl', GSM8K_ROWS)}")
    if expected is None:
        assert score(problems[1], prediction) == 1.0
    else:
        assert score(problems[0], prediction) == expected


# ---------------------------------------------------------------------------
# MATH
# ---------------------------------------------------------------------------

MATH_ROWS = [
    {"problem": "What is 1/2 of 1?", "solution": "Half of one is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1",
     "type": "Prealgebra"},
    {"problem": "Compute 3/4.", "solution": "It is $\\boxed{0.75}$."},
    {"problem": "Height of an equilateral triangle of side 1?",
     "solution": "By Pythagoras it is $\\boxed{\\frac{\\sqrt{3}}{2}}$."},
    {"problem": "Expand (x+1)^2.", "solution": "We get $\\boxed{x^2 + 2x + 1}$."},
]


def test_math_loads_boxed_reference(tmp_path):
    problems = load_dataset(f"math:{_jsonl(tmp_path, 'math.jsonl', MATH_ROWS)}")
    assert [p.answer for p in problems] == ["\\frac{1}{2}", "0.75", "\\frac{\\sqrt{3}}{2}", "x^2 + 2x + 1"]
    assert problems[0].metadata["level"] == "Level 1" and "boxed" in problems[0].metadata["solution"]


@pytest.mark.parametrize("index, prediction, expected", [
    (0, "So the answer is $\\boxed{0.5}$.", 1.0),
    (0, "\\boxed{1/2}", 1.0),
    (0, "\\boxed{\\dfrac{1}{2}}", 1.0),
    (0, "\\boxed{\\frac12}", 1.0),
    (0, "\\boxed{\\frac{1}{3}}", 0.0),
    (0, "First \\boxed{2}, then corrected: \\boxed{\\frac{1}{2}}", 1.0),  # the last box counts
    (1, "\\boxed{\\dfrac{3}{4}}", 1.0),
    (1, "\\boxed{\\frac{3}{4}}", 1.0),
    (1, "\\boxed{0.7505}", 1.0),   # AFlow's abs_tol 1e-3
    (1, "\\boxed{0.752}", 0.0),
    (2, "\\boxed{\\frac{\\sqrt3}{2}}", 1.0),
    (2, "\\boxed{\\sqrt{3}/2}", 1.0),
    (2, "\\boxed{\\frac{\\sqrt{2}}{2}}", 0.0),
    (3, "\\boxed{(x+1)^2}", 1.0),
    (3, "\\boxed{x^2+x+1}", 0.0),
    (3, "no box here. The answer is x^2+2x+1", 0.0),  # the last sentence, "The answer is ...", is no expression
])
def test_math_score_equivalence(tmp_path, index, prediction, expected):
    problems = load_dataset(f"math:{_jsonl(tmp_path, 'math.jsonl', MATH_ROWS)}")
    assert score(problems[index], prediction) == expected


@pytest.mark.parametrize("a, b, equal", [
    ("\\frac{1}{2}", "0.5", True), ("\\frac{1}{2}", "1/2", True), ("0.5", "1/2", True),
    ("5.0", "5", True), ("5 \\text{ cm}", "5", True), ("30^\\circ", "30", True), ("50\\%", "50", True),
    ("1,000", "1000", True), ("x = 5", "5", True), ("\\left( 1, 2 \\right)", "(1,2)", True),
    ("(1,2)", "(2,1)", False), ("1, -2", "-2, 1", True), ("[0,1)", "[0,1]", False),
    ("\\sqrt{8}", "2\\sqrt{2}", True), ("10!", "3628800", True), ("\\text{(A)}", "(A)", True),
    ("\\pi", "2\\pi", False), ("", "", False), ("9^{9^{9^{9}}}", "1", False),
])
def test_math_equal_cases(a, b, equal):
    assert math_equal(a, b) is equal


def test_boxed_extraction_balances_braces():
    assert extract_boxed("x \\boxed{\\frac{a}{\\sqrt{b}}} y") == "\\frac{a}{\\sqrt{b}}"
    assert extract_boxed("\\boxed 7$") == "7"
    assert extract_boxed("nothing") is None


def test_math_answers_are_never_evaluated_as_code(tmp_path):
    marker = tmp_path / "pwned"
    problem = Problem("m", "math", "q", "1")
    prediction = f"\\boxed{{__import__('os').system('touch {marker}')}}"
    assert score(problem, prediction) == 0.0
    assert not marker.exists()


# ---------------------------------------------------------------------------
# HotpotQA and DROP: token F1
# ---------------------------------------------------------------------------

HOTPOT_ROWS = [{"_id": "5a8b", "question": "Where is the Eiffel Tower?", "answer": "the Eiffel Tower",
                "context": [["Eiffel Tower", ["The Eiffel Tower is in Paris.", " It is tall."]],
                            ["Paris", ["Paris is in France."]]]}]


def test_hotpotqa_question_and_f1(tmp_path):
    [p] = load_dataset(f"hotpotqa:{_jsonl(tmp_path, 'hotpot.jsonl', HOTPOT_ROWS)}")
    assert p.id == "5a8b"
    assert p.question == ("Context: The Eiffel Tower is in Paris.  It is tall.\nParis is in France.\n\n"
                          "Question: Where is the Eiffel Tower?\n\nAnswer:")
    # gold tokens {eiffel, tower}; prediction {eiffel, tower, in, paris}: P = 2/4, R = 2/2, F1 = 2/3
    assert score(p, "Eiffel Tower in Paris!") == pytest.approx(2 / 3)
    assert score(p, "An EIFFEL tower.") == 1.0  # case, punctuation and articles do not count
    assert score(p, "London") == 0.0


def test_f1_hand_computed():
    # pred {a:1, b:2, c:1} (4 tokens), gold {b:1, c:1, d:1} (3 tokens): overlap b + c = 2 -> P 1/2, R 2/3
    assert f1("alpha beta beta gamma", "beta gamma delta") == pytest.approx(2 * 0.5 * (2 / 3) / (0.5 + 2 / 3))
    assert f1("", "x") == 0.0


DROP_ROWS = [{"id": "d1", "context": "Passage: ... Question: How many touchdowns?", "completion": "4",
              "ref_text": "4|four"},
             {"id": "d2", "context": "Passage: ... Question: Who scored?", "ref_text": "John Smith|Smith"}]


def test_drop_max_f1_over_gold_answers(tmp_path):
    d1, d2 = load_dataset(f"drop:{_jsonl(tmp_path, 'drop.jsonl', DROP_ROWS)}")
    assert d1.question == DROP_ROWS[0]["context"] and d1.answer == "4|four"
    assert score(d1, "4") == 1.0
    assert score(d1, "Four.") == 1.0
    assert score(d1, "about 4 yards") == pytest.approx(0.5)  # P 1/3, R 1 against "4"
    assert score(d1, "5") == 0.0
    assert score(d1, "5|four") == 1.0  # prediction parts are tried too
    assert score(d2, "Smith") == 1.0   # max(F1 vs "john smith" = 2/3, F1 vs "smith" = 1)
    assert drop_f1("John", ["John Smith", "Smith"]) == pytest.approx(2 / 3)


# ---------------------------------------------------------------------------
# HumanEval and MBPP: tests run in the sandbox
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def humaneval():
    return load_dataset("humaneval")


def test_humaneval_bundled_correct_and_wrong(humaneval):
    assert len(humaneval) == 164
    p = humaneval[0]
    assert p.id == "HumanEval/0" and p.kind == "humaneval" and p.metadata["entry_point"] == "has_close_elements"
    assert score(p, p.answer) == 1.0  # the canonical body, completing the prompt
    whole = "```python\n" + p.metadata["prompt"] + p.answer + "\n```\nThis works because..."
    assert score(p, whole) == 1.0     # a whole function in a fenced reply
    wrong = "def has_close_elements(numbers, threshold):\n    return False\n"
    assert score(p, wrong) == 0.0


def test_humaneval_prompt_helpers_available_and_demo_code_skipped(humaneval):
    p = next(q for q in humaneval if q.metadata["entry_point"] == "decode_cyclic")
    # The solution uses encode_cyclic, which only the prompt defines; the demo block must not run.
    solution = ("def decode_cyclic(s: str):\n    return encode_cyclic(encode_cyclic(s))\n\n"
                "if __name__ == '__main__':\n    print(decode_cyclic(input()))\n")
    assert score(p, solution) == 1.0
    parts = judge_parts(p, solution)
    assert parts["call"] == "candidate" and parts["entry_point"] == "decode_cyclic"
    assert "def encode_cyclic" in parts["setup"] and "def check" in parts["tests"]
    assert "def check" not in parts["solution"]  # the candidate's process never holds the tests


def test_humaneval_infinite_loop_is_a_failure(humaneval):
    p = humaneval[0]
    assert score(p, "def has_close_elements(numbers, threshold):\n    while True:\n        pass\n",
                 timeout_s=1.5) == 0.0


MBPP_ROWS = [{"task_id": 2, "prompt": "Write a function to add two numbers.", "entry_point": "add_nums",
              "code": "def add_nums(a, b):\n    return a + b", "test_imports": ["import math"],
              "test": "def check():\n    assert add_nums(1, 2) == 3\n    assert add_nums(math.floor(2.5), 0) == 2\n"}]
HE_ROWS = [{"task_id": "HE/x", "prompt": "def sq(x):\n    \"\"\"Square x.\"\"\"\n", "entry_point": "sq",
            "canonical_solution": "    return x * x\n",
            "test": "def check(candidate):\n    assert candidate(3) == 9\n"}]


def test_mbpp_and_aflow_humaneval_files(tmp_path):
    [m] = load_dataset(f"mbpp:{_jsonl(tmp_path, 'mbpp.jsonl', MBPP_ROWS)}")
    assert m.id == "2" and m.question == MBPP_ROWS[0]["prompt"] and m.metadata["test_imports"] == ["import math"]
    assert score(m, "```python\ndef add_nums(a, b):\n    return a + b\n```") == 1.0
    assert score(m, "def add_nums(a, b):\n    return a - b") == 0.0
    [h] = load_dataset(f"humaneval:{_jsonl(tmp_path, 'he.jsonl', HE_ROWS)}")
    assert score(h, h.answer) == 1.0 and score(h, "    return x + x\n") == 0.0


# ---------------------------------------------------------------------------
# reasoning-gym
# ---------------------------------------------------------------------------


def test_reasoning_gym_generated_and_scored():
    problems = load_dataset("rg:basic_arithmetic", num_problems=5, seed=7)
    again = load_dataset("rg:basic_arithmetic", num_problems=5, seed=7)
    assert len(problems) == 5 and [p.question for p in problems] == [p.question for p in again]
    p = problems[0]
    assert p.kind == "rg" and p.id == "rg:basic_arithmetic/7/0"
    assert score(p, p.answer) == 1.0
    assert score(p, f"Thinking...<answer>{p.answer}</answer>") == 1.0
    assert score(p, str(int(float(p.answer)) + 1)) == 0.0
    # Problems round-trip through JSON task dicts (workers rebuild them with Problem(**d)).
    d = json.loads(json.dumps(dataclasses.asdict(p)))
    assert score(Problem(**d), p.answer) == 1.0


# ---------------------------------------------------------------------------
# Split and errors
# ---------------------------------------------------------------------------


def test_split_is_seeded_one_to_four():
    problems = [Problem(str(i), "gsm8k", f"q{i}", str(i)) for i in range(50)]
    val, test = split(problems, val_ratio=0.2, seed=42)
    assert (len(val), len(test)) == (10, 40)
    assert sorted(p.id for p in val + test) == sorted(p.id for p in problems)  # a partition
    assert [int(p.id) for p in val] == sorted(int(p.id) for p in val)         # original order kept
    val2, _ = split(problems, val_ratio=0.2, seed=42)
    val3, _ = split(problems, val_ratio=0.2, seed=43)
    assert [p.id for p in val2] == [p.id for p in val]
    assert [p.id for p in val3] != [p.id for p in val]
    assert [len(part) for part in split(problems[:3])] == [1, 2]  # never an empty side from 2+ problems


def test_num_problems_takes_the_first(tmp_path):
    path = _jsonl(tmp_path, "gsm8k.jsonl", GSM8K_ROWS)
    assert [p.answer for p in load_dataset(f"gsm8k:{path}", num_problems=2)] == ["18", "1,234"]


@pytest.mark.parametrize("spec", ["gsm9k:data.jsonl", "humaneval_plus", "rg:", "math:", "data.jsonl", ""])
def test_unknown_spec_names_the_valid_forms(spec):
    with pytest.raises(ValueError) as err:
        load_dataset(spec)
    msg = str(err.value)
    assert "'humaneval'" in msg and "rg:<reasoning-gym name>" in msg
    assert "gsm8k|math|humaneval|mbpp|hotpotqa|drop" in msg


def test_missing_file_and_bad_rows(tmp_path):
    missing = os.path.join(str(tmp_path), "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_dataset(f"gsm8k:{missing}")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "1"}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        load_dataset(f"gsm8k:{bad}")
    wrong = _jsonl(tmp_path, "wrong.jsonl", [{"question": "q"}])
    with pytest.raises(ValueError, match=r"wrong.jsonl:1: a gsm8k problem needs field\(s\) answer"):
        load_dataset(f"gsm8k:{wrong}")
    with pytest.raises(ValueError, match="rg:no_such_dataset"):
        load_dataset("rg:no_such_dataset")


def test_unknown_kind_has_no_scorer():
    with pytest.raises(ValueError, match="no scorer for kind 'poetry'"):
        score(Problem("p", "poetry", "q", "a"), "a")


def test_scores_are_in_unit_interval(tmp_path):
    [p] = load_dataset(f"hotpotqa:{_jsonl(tmp_path, 'hotpot.jsonl', HOTPOT_ROWS)}")
    for pred in ["", "the", "Eiffel", "Eiffel Tower Eiffel Tower", None]:
        s = score(p, pred)
        assert 0.0 <= s <= 1.0 and not math.isnan(s)
