"""A seeded, local, deterministic knowledge base: the world swarm tasks are about.

The world is invented (pronounceable names from syllables, no real facts), so a
model cannot answer from memory and every answer is checkable offline. Four
entity types, linked by relations that always lead to another entity (so
random walks of any length exist) and ending in numeric attributes:

    country: capital -> city, leader -> person, area, founded
    city:    country -> country, river -> river, mayor -> person, population, founded
    river:   source -> city, length
    person:  birthplace -> city, born

``build_kb(seed)`` is cached per process: the same seed gives the same world in
every worker, which is what lets a task dict carry only ``kb_seed``.
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field

# Entity-valued attributes per type, and the type each one leads to.
RELATIONS: dict[str, dict[str, str]] = {
    "country": {"capital": "city", "leader": "person"},
    "city": {"country": "country", "river": "river", "mayor": "person"},
    "river": {"source": "city"},
    "person": {"birthplace": "city"},
}
# Numeric attributes per type with their (low, high) ranges.
NUMBERS: dict[str, dict[str, tuple[int, int]]] = {
    "country": {"area": (1_000, 900_000), "founded": (800, 1990)},
    "city": {"population": (1_000, 2_000_000), "founded": (700, 1990)},
    "river": {"length": (40, 4_000)},
    "person": {"born": (1900, 2005)},
}
# How an attribute reads inside a question ("the founding year of the capital of X").
LABELS = {
    "capital": "capital", "leader": "leader", "country": "country", "river": "river",
    "mayor": "mayor", "source": "source city", "birthplace": "birthplace",
    "area": "area in square km", "founded": "founding year", "population": "population",
    "length": "length in km", "born": "birth year",
}
SIZES = {"country": 12, "city": 48, "river": 16, "person": 40}

_ONSETS = ("b", "br", "d", "dr", "f", "g", "k", "kr", "l", "m", "n", "p", "r", "s", "st", "t", "tr",
           "v", "z", "h", "j")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ia", "ou")
_CODAS = ("", "", "n", "r", "l", "s", "th", "m", "x")
_SUFFIX = {"country": ("ia", "ora", "and", "istan"), "city": ("ton", "burg", "mar", "is"),
           "river": ("", "", "a", "e"), "person": ("", "o", "a", "in")}


@dataclass
class KnowledgeBase:
    """Entities by name (names are unique) with their type and attribute values (all strings)."""

    seed: int
    types: dict[str, str] = field(default_factory=dict)          # name -> type
    facts: dict[str, dict[str, str]] = field(default_factory=dict)  # name -> {attribute: value}
    _by_lower: dict[str, str] = field(default_factory=dict)

    def entity(self, name: str) -> str | None:
        """The canonical name of ``name`` (case and surrounding spaces ignored), or None."""
        return self._by_lower.get(str(name).strip().lower())

    def attributes(self, name: str) -> list[str]:
        ent = self.entity(name)
        return sorted(self.facts[ent]) if ent else []

    def lookup(self, name: str, attribute: str) -> str:
        """The value of ``attribute`` of entity ``name``; KeyError with a readable message otherwise."""
        ent = self.entity(name)
        if ent is None:
            raise KeyError(f"no entity named {name!r}")
        attr = str(attribute).strip().lower()
        if attr not in self.facts[ent]:
            raise KeyError(f"{ent} ({self.types[ent]}) has no attribute {attribute!r}; "
                           f"it has {', '.join(sorted(self.facts[ent]))}")
        return self.facts[ent][attr]

    def names(self, kind: str) -> list[str]:
        """Entities of one type, in creation order (deterministic)."""
        return [n for n, t in self.types.items() if t == kind]


def _name(rng: random.Random, kind: str, taken: set[str]) -> str:
    while True:
        parts = [rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(1, 2))]
        name = ("".join(parts) + rng.choice(_SUFFIX[kind])).capitalize()
        if len(name) >= 4 and name.lower() not in taken:
            taken.add(name.lower())
            return name


@functools.lru_cache(maxsize=8)
def build_kb(seed: int = 0) -> KnowledgeBase:
    """The world of ``seed``: same seed, same entities and facts, in any process."""
    rng = random.Random(f"swarm-kb-{seed}")
    kb = KnowledgeBase(seed=seed)
    taken: set[str] = set()
    for kind, n in SIZES.items():
        for _ in range(n):
            name = _name(rng, kind, taken)
            kb.types[name] = kind
            kb.facts[name] = {}
    countries, cities = kb.names("country"), kb.names("city")
    rivers, people = kb.names("river"), kb.names("person")
    per_country = len(cities) // len(countries)
    for i, city in enumerate(cities):
        kb.facts[city]["country"] = countries[min(i // per_country, len(countries) - 1)]
        kb.facts[city]["river"] = rng.choice(rivers)
        kb.facts[city]["mayor"] = rng.choice(people)
    for i, country in enumerate(countries):
        kb.facts[country]["capital"] = cities[i * per_country + rng.randrange(per_country)]
        kb.facts[country]["leader"] = rng.choice(people)
    for river in rivers:
        kb.facts[river]["source"] = rng.choice(cities)
    for person in people:
        kb.facts[person]["birthplace"] = rng.choice(cities)
    for name, kind in kb.types.items():
        for attr, (lo, hi) in NUMBERS[kind].items():
            kb.facts[name][attr] = str(rng.randint(lo, hi))
    kb._by_lower = {n.lower(): n for n in kb.types}
    return kb
