"""SharedExperiencePool: every proposal the optimizer made, in one SQLite file.

AFlow keeps one ``experience.json`` per round (parent round, modification,
score before and after, success) and shows the optimizer what was already
tried from a parent. Here the same record is a row of a SQLite database that
many processes share: the search loop and every rollout worker append to it
at once, MCTS reads its per-parent statistics as Q-values, and it survives a
kill and a restart.

Process safety: WAL journal (readers never block the writer), a busy timeout
on every connection, and one short ``BEGIN IMMEDIATE`` transaction per write
(retried if the lock is still held after the timeout). The handle stores only
the path: it pickles, and each process (or a forked child) opens its own
connection on first use. WAL needs a local file system, not NFS.

    pool = SharedExperiencePool("runs/x/search/experience.db")
    pool.add(Experience(parent_hash=p, child_hash=c, accepted=True, parent_score=0.4,
                        child_score=0.5, improvement=0.1, round=2, source="search"))
    pool.parent_stats(p)          # QStats(visits=1, mean_improvement=0.1, ...)
    pool.export("experience.jsonl")
"""
from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal

_SCHEMA = """
CREATE TABLE IF NOT EXISTS experience (
    id             INTEGER PRIMARY KEY AUTOINCREMENT,
    key            TEXT UNIQUE,            -- idempotency key (search/round-7, train/<episode>); NULL: always new
    round          INTEGER NOT NULL DEFAULT 0,
    source         TEXT NOT NULL DEFAULT '',
    parent_hash    TEXT NOT NULL DEFAULT '',
    child_hash     TEXT NOT NULL DEFAULT '',
    child_workflow TEXT NOT NULL DEFAULT '',
    modification   TEXT NOT NULL DEFAULT '',
    parent_score   REAL,
    child_score    REAL,                   -- NULL: never executed (rejected)
    improvement    REAL,                   -- child - parent; the penalty when rejected; NULL for a root
    cost           REAL NOT NULL DEFAULT 0,
    run_scores     TEXT NOT NULL DEFAULT '[]',
    accepted       INTEGER NOT NULL,
    reason         TEXT NOT NULL DEFAULT '',
    created        REAL NOT NULL,
    info           TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS experience_parent ON experience(parent_hash);
CREATE INDEX IF NOT EXISTS experience_child ON experience(child_hash);
CREATE INDEX IF NOT EXISTS experience_score ON experience(child_score);
"""

_COLUMNS = ("key", "round", "source", "parent_hash", "child_hash", "child_workflow", "modification",
            "parent_score", "child_score", "improvement", "cost", "run_scores", "accepted", "reason",
            "created", "info")

# Connections inherited through fork() must not be used or closed in the child
# (SQLite's rule: closing one can drop the parent's locks); they are parked here.
_FORKED_OVER: list[sqlite3.Connection] = []


@dataclass
class Experience:
    """One proposal: parent -> child, its outcome, and why it was accepted or rejected.

    ``improvement`` is child − parent score for an executed child, the format
    penalty for a rejected one, and None for a root (the initial workflow's
    own evaluation, which has no parent). ``run_scores`` are the scores of the
    ``validation_runs`` evaluations whose mean is ``child_score``.
    """

    parent_hash: str = ""
    child_hash: str = ""
    accepted: bool = False
    parent_score: float | None = None
    child_score: float | None = None
    improvement: float | None = None
    modification: str = ""
    child_workflow: str = ""
    cost: float = 0.0
    run_scores: list[float] = field(default_factory=list)
    reason: str = ""
    round: int = 0
    source: str = ""
    key: str | None = None
    created: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    id: int | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class QStats:
    """Visit statistics of a parent (its proposals) or a child (the records that produced it)."""

    visits: int = 0                   # records
    accepted: int = 0                 # of which executed
    mean_improvement: float = 0.0     # over records with an improvement (rejected ones: the penalty)
    mean_score: float | None = None   # mean child score of the executed ones
    best_score: float | None = None


def _row_to_experience(row: sqlite3.Row) -> Experience:
    d = dict(row)
    d["accepted"] = bool(d["accepted"])
    d["run_scores"] = json.loads(d["run_scores"] or "[]")
    d["info"] = json.loads(d["info"] or "{}")
    return Experience(**d)


def _stats(row: sqlite3.Row | None) -> QStats:
    if row is None or not row["visits"]:
        return QStats()
    return QStats(visits=int(row["visits"]), accepted=int(row["accepted"] or 0),
                  mean_improvement=float(row["mean_improvement"] or 0.0),
                  mean_score=None if row["mean_score"] is None else float(row["mean_score"]),
                  best_score=None if row["best_score"] is None else float(row["best_score"]))


_STATS_SQL = ("COUNT(*) AS visits, SUM(accepted) AS accepted, AVG(improvement) AS mean_improvement, "
              "AVG(CASE WHEN accepted THEN child_score END) AS mean_score, "
              "MAX(CASE WHEN accepted THEN child_score END) AS best_score")


class SharedExperiencePool:
    """A process-safe, persistent store of ``Experience`` records (see the module docstring)."""

    def __init__(self, path: str, *, busy_timeout_s: float = 30.0, write_retries: int = 5):
        self.path = os.path.abspath(path)
        self.busy_timeout_s = float(busy_timeout_s)
        self.write_retries = int(write_retries)
        self._conn: sqlite3.Connection | None = None
        self._pid = 0
        self._lock = threading.Lock()

    # -- pickling: only the path travels; each process reconnects lazily --------------------------

    def __getstate__(self) -> dict:
        return {"path": self.path, "busy_timeout_s": self.busy_timeout_s, "write_retries": self.write_retries}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], busy_timeout_s=state["busy_timeout_s"],
                      write_retries=state["write_retries"])

    def __repr__(self) -> str:
        return f"SharedExperiencePool({self.path!r})"

    # -- connection ---------------------------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        pid = os.getpid()
        if self._conn is not None and self._pid != pid:
            _FORKED_OVER.append(self._conn)
            self._conn = None
        if self._conn is None:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            # isolation_level=None: we issue BEGIN/COMMIT ourselves, keeping transactions short.
            conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None,
                                   check_same_thread=False)
            conn.row_factory = sqlite3.Row
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
            # Switching to WAL takes an exclusive lock; another process doing the same
            # at this instant can make it fail with "locked" despite the busy timeout.
            self._retry(lambda: conn.execute("PRAGMA journal_mode = WAL").fetchone())
            conn.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL: durable across process kills
            self._retry(lambda: conn.executescript(_SCHEMA))
            self._conn, self._pid = conn, pid
        return self._conn

    def _retry(self, fn):
        for attempt in range(self.write_retries + 1):
            try:
                return fn()
            except sqlite3.OperationalError as exc:
                if ("locked" not in str(exc) and "busy" not in str(exc)) or attempt == self.write_retries:
                    raise
                time.sleep(0.05 * 2 ** attempt)

    def _write(self, sql: str, params: tuple) -> tuple[int, int]:
        """Run one statement in its own ``BEGIN IMMEDIATE`` transaction; return (lastrowid, rowcount)."""
        with self._lock:
            conn = self._connection()

            def txn() -> tuple[int, int]:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    cur = conn.execute(sql, params)
                    conn.execute("COMMIT")
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
                return int(cur.lastrowid or 0), int(cur.rowcount)

            return self._retry(txn)

    def _read(self, sql: str, params: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            conn = self._connection()
            return self._retry(lambda: conn.execute(sql, params).fetchall())

    def close(self) -> None:
        """Close this process's connection (the handle reconnects on next use)."""
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None

    # -- writing ------------------------------------------------------------------------------------

    def add(self, exp: Experience, *, on_conflict: Literal["replace", "ignore"] = "replace") -> int:
        """Store a record; return its id.

        A record with a ``key`` that is already stored replaces it
        (``on_conflict="replace"``: a resumed round redoes its record) or is
        dropped (``"ignore"``: the first writer wins, e.g. a root evaluated by
        several workers at once; the stored record's id is returned).
        """
        values = dataclasses.replace(exp, created=exp.created or time.time())
        row = {c: getattr(values, c) for c in _COLUMNS}
        row["run_scores"] = json.dumps([float(s) for s in values.run_scores])
        row["info"] = json.dumps(values.info, default=str)
        row["accepted"] = int(bool(values.accepted))
        verb = "INSERT OR REPLACE" if on_conflict == "replace" else "INSERT OR IGNORE"
        sql = f"{verb} INTO experience ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"
        rowid, _ = self._write(sql, tuple(row[c] for c in _COLUMNS))
        if on_conflict == "ignore" and exp.key is not None:
            stored = self.get(exp.key)
            return stored.id if stored is not None else rowid
        return rowid

    def remove(self, key: str) -> int:
        """Delete the record stored under ``key``; return how many were deleted (0 or 1)."""
        return self._write("DELETE FROM experience WHERE key = ?", (key,))[1]

    # -- reading ------------------------------------------------------------------------------------

    def get(self, key: str) -> Experience | None:
        rows = self._read("SELECT * FROM experience WHERE key = ?", (key,))
        return _row_to_experience(rows[0]) if rows else None

    def count(self) -> int:
        return int(self._read("SELECT COUNT(*) FROM experience")[0][0])

    def records(self) -> list[Experience]:
        """Every record, oldest first."""
        return [_row_to_experience(r) for r in self._read("SELECT * FROM experience ORDER BY id")]

    def __iter__(self) -> Iterator[Experience]:
        return iter(self.records())

    def __len__(self) -> int:
        return self.count()

    def by_parent(self, parent_hash: str, *, limit: int = 0) -> list[Experience]:
        """Proposals made from ``parent_hash``, oldest first (``limit`` > 0: the newest ``limit``)."""
        if limit > 0:
            rows = self._read("SELECT * FROM (SELECT * FROM experience WHERE parent_hash = ? "
                              "ORDER BY id DESC LIMIT ?) ORDER BY id", (parent_hash, limit))
        else:
            rows = self._read("SELECT * FROM experience WHERE parent_hash = ? ORDER BY id", (parent_hash,))
        return [_row_to_experience(r) for r in rows]

    def by_child(self, child_hash: str) -> list[Experience]:
        """Records that produced (or evaluated) ``child_hash``, oldest first."""
        rows = self._read("SELECT * FROM experience WHERE child_hash = ? ORDER BY id", (child_hash,))
        return [_row_to_experience(r) for r in rows]

    def top(self, n: int, *, distinct: bool = True) -> list[Experience]:
        """The ``n`` best executed records by child score (ties: oldest first).

        ``distinct``: one record per child workflow (its best-scoring one).
        """
        rows = self._read("SELECT * FROM experience WHERE accepted AND child_score IS NOT NULL "
                          "ORDER BY child_score DESC, id ASC")
        out, seen = [], set()
        for r in rows:
            if distinct and r["child_hash"] in seen:
                continue
            seen.add(r["child_hash"])
            out.append(_row_to_experience(r))
            if len(out) >= n:
                break
        return out

    def parent_stats(self, parent_hash: str) -> QStats:
        """Q statistics of expanding ``parent_hash``: visits and mean improvement of its proposals."""
        rows = self._read(f"SELECT {_STATS_SQL} FROM experience WHERE parent_hash = ?", (parent_hash,))
        return _stats(rows[0] if rows else None)

    def q_values(self) -> dict[str, QStats]:
        """``parent_stats`` of every parent, in one query."""
        rows = self._read(f"SELECT parent_hash, {_STATS_SQL} FROM experience WHERE parent_hash != '' "
                          "GROUP BY parent_hash")
        return {r["parent_hash"]: _stats(r) for r in rows}

    def nodes(self) -> list[dict]:
        """Every executed workflow once, in order of first appearance.

        Each: ``hash``, ``parent_hash`` and ``workflow`` of its first record,
        ``score`` (mean over all its executed records), ``evaluations``,
        ``first_id``. This is the search tree as the pool knows it.
        """
        rows = self._read("SELECT child_hash AS hash, MIN(id) AS first_id, AVG(child_score) AS score, "
                          "COUNT(*) AS evaluations FROM experience "
                          "WHERE accepted AND child_score IS NOT NULL AND child_hash != '' "
                          "GROUP BY child_hash ORDER BY first_id")
        firsts = {r["id"]: r for r in self._read(
            "SELECT id, parent_hash, child_workflow FROM experience WHERE id IN "
            "(SELECT MIN(id) FROM experience WHERE accepted AND child_score IS NOT NULL GROUP BY child_hash)")}
        return [{"hash": r["hash"], "parent_hash": firsts[r["first_id"]]["parent_hash"],
                 "workflow": firsts[r["first_id"]]["child_workflow"], "score": float(r["score"]),
                 "evaluations": int(r["evaluations"]), "first_id": int(r["first_id"])} for r in rows]

    def export(self, path: str) -> int:
        """Write every record as one JSON line, oldest first; return how many."""
        records = self.records()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as fh:
            for rec in records:
                fh.write(json.dumps(rec.to_dict(), default=str) + "\n")
        os.replace(tmp, path)
        return len(records)
