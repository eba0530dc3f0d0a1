"""Stand-ins shared by the AFlow tests."""
from dataclasses import dataclass, field


@dataclass
class Problem:
    """Stand-in with the fields of ``datasets.Problem`` (positional order id, question, answer, kind),
    so the graph and evaluator tests need no dataset."""

    id: str
    question: str
    answer: str = ""
    kind: str = "qa"
    metadata: dict = field(default_factory=dict)
