"""SharedExperiencePool: concurrent writers lose nothing, it persists, queries, pickles, exports."""
import json
import multiprocessing as mp
import os
import pickle

import pytest

from aflow_rl.envs.aflow.experience import Experience, SharedExperiencePool

WRITERS, WRITES = 4, 50


def _writer(pool: SharedExperiencePool, worker: int, n: int) -> None:
    for i in range(n):
        pool.add(Experience(parent_hash=f"p{i % 3}", child_hash=f"w{worker}-{i}", accepted=i % 5 != 0,
                            parent_score=0.5, child_score=None if i % 5 == 0 else i / n,
                            improvement=-0.1 if i % 5 == 0 else i / n - 0.5, source=f"worker{worker}",
                            key=f"w{worker}/{i}", run_scores=[i / n]))


def _rec(parent="p", child="c", score=0.5, parent_score=0.4, **kw) -> Experience:
    if "improvement" not in kw:
        kw["improvement"] = None if score is None or parent_score is None else score - parent_score
    return Experience(parent_hash=parent, child_hash=child, accepted=score is not None, parent_score=parent_score,
                      child_score=score, **kw)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_many_processes_lose_no_record(tmp_path, method):
    pool = SharedExperiencePool(str(tmp_path / "exp.db"))
    pool.add(_rec(key="before"))  # the parent holds an open connection while children write
    ctx = mp.get_context(method)
    procs = [ctx.Process(target=_writer, args=(pool, w, WRITES)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert pool.count() == WRITERS * WRITES + 1
    keys = {r.key for r in pool.records()}
    assert keys == {"before"} | {f"w{w}/{i}" for w in range(WRITERS) for i in range(WRITES)}
    # A fresh handle (a restart) sees the same.
    assert SharedExperiencePool(str(tmp_path / "exp.db")).count() == WRITERS * WRITES + 1


def test_persists_and_reloads(tmp_path):
    path = str(tmp_path / "sub" / "exp.db")
    pool = SharedExperiencePool(path)
    rid = pool.add(_rec(modification="add ScEnsemble", run_scores=[0.4, 0.6], cost=0.25, round=2,
                        source="search", key="search/2", info={"failures": 3}))
    pool.close()
    again = SharedExperiencePool(path)
    (rec,) = again.records()
    assert rec.id == rid and rec.modification == "add ScEnsemble" and rec.run_scores == [0.4, 0.6]
    assert rec.cost == 0.25 and rec.round == 2 and rec.info == {"failures": 3} and rec.accepted
    assert rec.created > 0
    assert os.path.exists(path + "-wal") or os.path.exists(path)


def test_keys_replace_or_ignore(tmp_path):
    pool = SharedExperiencePool(str(tmp_path / "exp.db"))
    pool.add(_rec(score=0.1, key="search/3"))
    pool.add(_rec(score=0.7, key="search/3"))                       # a resumed round redoes its record
    assert pool.count() == 1 and pool.get("search/3").child_score == 0.7
    first = pool.add(_rec(child="root", parent="", score=0.2, key="root/x"), on_conflict="ignore")
    second = pool.add(_rec(child="root", parent="", score=0.9, key="root/x"), on_conflict="ignore")
    assert first == second and pool.get("root/x").child_score == 0.2  # the first writer wins
    pool.add(_rec(key=None))
    pool.add(_rec(key=None))                                          # no key: always a new record
    assert pool.count() == 4
    assert pool.remove("search/3") == 1 and pool.remove("search/3") == 0
    assert pool.get("search/3") is None and pool.count() == 3


def test_queries_by_parent_score_and_q_statistics(tmp_path):
    pool = SharedExperiencePool(str(tmp_path / "exp.db"))
    pool.add(_rec(parent="", child="A", score=0.4, parent_score=None, improvement=None, key="root"))
    pool.add(_rec(parent="A", child="B", score=0.6, parent_score=0.4, modification="m1"))
    pool.add(_rec(parent="A", child="C", score=0.3, parent_score=0.4, modification="m2"))
    pool.add(_rec(parent="A", child="", score=None, parent_score=0.4, improvement=-0.1, reason="cycle"))
    pool.add(_rec(parent="B", child="D", score=0.8, parent_score=0.6))
    pool.add(_rec(parent="C", child="B", score=0.5, parent_score=0.3))  # B found again, scored 0.5

    assert [r.modification for r in pool.by_parent("A")] == ["m1", "m2", ""]
    assert [r.reason for r in pool.by_parent("A", limit=1)] == ["cycle"]
    qa = pool.parent_stats("A")
    assert (qa.visits, qa.accepted) == (3, 2)
    assert qa.mean_improvement == pytest.approx((0.2 - 0.1 - 0.1) / 3)
    assert qa.mean_score == pytest.approx(0.45) and qa.best_score == pytest.approx(0.6)
    assert pool.parent_stats("nobody").visits == 0
    assert set(pool.q_values()) == {"A", "B", "C"}

    assert [r.child_hash for r in pool.top(3)] == ["D", "B", "A"]                # B once (its best)
    assert [r.child_hash for r in pool.top(3, distinct=False)] == ["D", "B", "B"]
    nodes = pool.nodes()
    assert [n["hash"] for n in nodes] == ["A", "B", "C", "D"]
    assert nodes[1]["parent_hash"] == "A" and nodes[1]["score"] == pytest.approx(0.55)
    assert nodes[1]["evaluations"] == 2


def _child_reads(blob: bytes, queue) -> None:
    pool = pickle.loads(blob)
    pool.add(_rec(child="from-child", key="child"))
    queue.put(pool.count())


def test_pickled_handle_reconnects_in_a_child_process(tmp_path):
    pool = SharedExperiencePool(str(tmp_path / "exp.db"))
    pool.add(_rec(key="parent"))
    blob = pickle.dumps(pool)
    assert b"sqlite3" not in blob and len(blob) < 500  # only the path travels
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_reads, args=(blob, queue))
    proc.start()
    assert queue.get(timeout=60) == 2
    proc.join(30)
    assert proc.exitcode == 0
    assert pool.get("child").child_hash == "from-child"


def test_export_jsonl(tmp_path):
    pool = SharedExperiencePool(str(tmp_path / "exp.db"))
    pool.add(_rec(child="a", run_scores=[0.5], info={"k": 1}))
    pool.add(_rec(child="b", score=None, improvement=-0.1, reason="unknown operator Foo"))
    out = tmp_path / "out" / "experience.jsonl"
    assert pool.export(str(out)) == 2
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["child_hash"] for r in rows] == ["a", "b"]
    assert rows[0]["run_scores"] == [0.5] and rows[0]["info"] == {"k": 1} and rows[0]["accepted"] is True
    assert rows[1]["accepted"] is False and rows[1]["reason"] == "unknown operator Foo"
    assert rows[1]["child_score"] is None
